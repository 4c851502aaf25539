"""Fairshare's Tasks backend at enqueue and when read back, in this process (modelled on the
django-tasks project's own backend tests): what `enqueue()` stores and returns, what it refuses and
why (nothing stored or sent), `get_result` / `aget_result` / `refresh`, and the backend's checks."""
import asyncio
import datetime as dt
import math
import uuid

import pytest
from django.db import transaction
from django.test import override_settings
from django.utils import timezone
from django_q.models import OrmQ

from scheduling.envelope import parse
from scheduling.models import DeferReason, DeferredTask
from tasks.backend import FairshareBackend
from tasks.compat import (
    InvalidTask, TaskResultDoesNotExist, TaskResultStatus, default_task_backend, task_backends, task_enqueued,
)
from tasks.exceptions import CallRefused
from tasks.models import TaskCall
from tests.factories import AccountFactory
from tests.tasks import functions as f
from tests.tasks.conftest import nothing_stored

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

TASKS = {"default": {"BACKEND": "tasks.backend.FairshareBackend", "QUEUES": ["default", "exports"],
                     "OPTIONS": {"SYSTEM_TASKS": ["tests.tasks.functions.system_chore"]}}}


def test_the_default_backend_is_fairshares_and_its_checks_pass():
    assert isinstance(task_backends["default"], FairshareBackend)
    assert list(default_task_backend.check()) == []
    for feature in ("supports_defer", "supports_priority", "supports_async_task", "supports_get_result"):
        assert getattr(default_task_backend, feature) is True


def test_enqueue_stores_the_call_and_returns_a_ready_result(account, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        result = f.echo.enqueue(1, "two", [3], account=account, four={"five": 5})

    assert result.status == TaskResultStatus.READY
    assert (result.args, result.kwargs) == ([1, "two", [3]], {"four": {"five": 5}})
    assert result.task == f.echo and result.backend == "default"
    assert result.enqueued_at is not None and result.started_at is None and result.finished_at is None
    assert (result.attempts, result.worker_ids, result.errors) == (0, [], [])
    with pytest.raises(ValueError, match="Task has not finished yet"):
        result.return_value  # noqa: B018
    call = TaskCall.objects.get(pk=result.id)
    assert (call.account_id, call.queue, call.task_path) == (account.pk, "default", "tests.tasks.functions.echo")
    # The broker's message is the kernel's envelope: identifiers only, naming the call.
    message = OrmQ.objects.get().task["args"][0]
    assert parse(message).ref == result.id and parse(message).job == "tasks.run.default"
    assert set(message) == {"v", "job", "account", "ref", "priority"} and message["account"] == account.pk


def test_the_priority_goes_in_the_envelope_and_a_later_run_after_holds_the_call(
        account, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        urgent = f.noop.using(priority=70).enqueue(account=account)
        now_due = f.noop.using(run_after=timezone.now() - dt.timedelta(seconds=1)).enqueue(account=account)
        later = f.noop.using(run_after=timezone.now() + dt.timedelta(hours=1)).enqueue(account=account)
    sent = {m.task["args"][0]["ref"]: m.task["args"][0] for m in OrmQ.objects.all()}
    assert set(sent) == {urgent.id, now_due.id} and sent[urgent.id]["priority"] == 70
    held = DeferredTask.objects.get(ref=later.id)  # not in the broker, no slot taken: waiting for its time
    assert (held.reason, held.eligible_at, held.job) == (DeferReason.SCHEDULED, later.task.run_after, "tasks.run.default")
    assert later.status == TaskResultStatus.READY and later.task.run_after == TaskCall.objects.get(pk=later.id).run_after


def test_the_account_can_be_an_id_and_a_function_that_asks_for_it_receives_it(account):
    result = f.whose.enqueue(account=account.pk, label="report")
    assert result.kwargs == {"label": "report", "account": account.pk}
    assert TaskCall.objects.get(pk=result.id).arguments == {"args": [], "kwargs": {"label": "report"}}
    # A function without that parameter does not see it.
    assert f.echo.enqueue(account=account).kwargs == {}


@pytest.mark.parametrize(("value", "code"), [
    ("missing", "account_missing"), (999999, "account_unknown"), ("inactive", "account_inactive"),
    ("1", "account_invalid"), (True, "account_invalid"), (None, "account_invalid"), (1.0, "account_invalid"),
])
def test_a_call_without_a_valid_active_account_is_refused_and_nothing_is_stored(value, code):
    kwargs = {}
    if value == "inactive":
        kwargs["account"] = AccountFactory(slug="gone", is_active=False)
    elif value != "missing":
        kwargs["account"] = value
    with pytest.raises(CallRefused) as refused:
        f.noop.enqueue(**kwargs)
    assert refused.value.code == code
    assert isinstance(refused.value, InvalidTask)  # what code written for any backend catches
    assert nothing_stored()


@override_settings(TASKS=TASKS)
def test_a_system_task_runs_for_no_account_and_refuses_one(account, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        result = f.system_chore.enqueue()
    call = TaskCall.objects.get(pk=result.id)
    assert call.account_id is None
    assert parse(OrmQ.objects.get().task["args"][0]).job == "tasks.system.default"
    with pytest.raises(CallRefused) as refused:
        f.system_chore.enqueue(account=account)
    assert refused.value.code == "account_not_allowed"
    assert TaskCall.objects.count() == 1


@pytest.mark.parametrize(("args", "code"), [
    ((object(),), "arguments_not_json"), ((math.nan,), "arguments_not_json"), ((b"\xff",), "arguments_not_json"),
    (("x" * 70_000,), "arguments_too_large"),
])
def test_arguments_that_cannot_be_stored_are_refused_and_nothing_is_stored(account, args, code):
    with pytest.raises(CallRefused) as refused:
        f.noop.enqueue(*args, account=account)
    assert refused.value.code == code
    assert nothing_stored()


@pytest.mark.parametrize("argument", [object(), math.nan, b"\xff"])
def test_an_argument_json_cannot_hold_is_refused_as_the_framework_does_and_as_fairshare_does(account, argument):
    # Portable code catches the framework's TypeError ("Unsupported type ..."); Fairshare's callers
    # catch CallRefused and read its code. Each catches this refusal.
    with pytest.raises(TypeError):
        f.noop.enqueue(argument, account=account)
    with pytest.raises(CallRefused, match="cannot be stored as JSON") as refused:
        f.noop.enqueue(argument, account=account)
    assert refused.value.code == "arguments_not_json" and isinstance(refused.value, InvalidTask)
    assert nothing_stored()


def test_the_argument_limit_is_a_setting(account, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "TASKS_MAX_ARGS_BYTES": 10}
    with pytest.raises(CallRefused, match="more than the 10 allowed"):
        f.noop.enqueue("a longer string", account=account)
    assert nothing_stored()


def test_a_call_enqueued_in_a_transaction_is_sent_when_it_commits_and_not_at_all_if_it_rolls_back(
        account, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        result = f.noop.enqueue(account=account)
        assert not OrmQ.objects.exists()  # the row is not visible to a worker yet: no message either
    assert len(callbacks) == 1 and OrmQ.objects.count() == 1
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            f.noop.enqueue(account=account)
            raise RuntimeError("the caller changed its mind")
    assert list(TaskCall.objects.values_list("pk", flat=True)) == [uuid.UUID(result.id)]


def test_task_enqueued_is_sent_with_the_result(account):
    seen = []

    def receiver(sender, task_result, **kwargs):
        seen.append((sender, task_result.id, task_result.status))

    task_enqueued.connect(receiver)
    try:
        result = f.noop.enqueue(account=account)
    finally:
        task_enqueued.disconnect(receiver)
    assert seen == [(FairshareBackend, result.id, TaskResultStatus.READY)]


def test_get_result_and_refresh_read_the_stored_call(account):
    result = f.meaning_of_life.enqueue(account=account)
    assert default_task_backend.get_result(result.id) == result
    assert f.meaning_of_life.get_result(result.id) == result

    now = timezone.now()
    TaskCall.objects.filter(pk=result.id).update(status=TaskResultStatus.SUCCESSFUL, return_value=42,
                                                 started_at=now, finished_at=now, workers="w:1\n")
    assert result.status == TaskResultStatus.READY
    result.refresh()
    assert (result.status, result.return_value, result.attempts, result.finished_at) == (
        TaskResultStatus.SUCCESSFUL, 42, 1, now)


# A fixed UUID that names no call: parameters must be the same in every pytest-xdist worker, which
# collects the tests on its own.
MISSING_ID = "0d6f3e39-4f7e-4a5b-9a55-3c8c1b0f6a2e"


@pytest.mark.parametrize("result_id", [MISSING_ID, "123", "", "not-a-uuid" * 10])
def test_get_result_of_a_missing_or_malformed_id_says_it_does_not_exist(result_id):
    with pytest.raises(TaskResultDoesNotExist):
        default_task_backend.get_result(result_id)
    with pytest.raises(TaskResultDoesNotExist):
        f.noop.get_result(result_id)


@pytest.mark.parametrize("result_id", [MISSING_ID, "123"])
def test_aget_result_of_a_missing_or_malformed_id_says_it_does_not_exist(result_id, close_async_connections):
    async def read():
        await default_task_backend.aget_result(result_id)

    with pytest.raises(TaskResultDoesNotExist):
        asyncio.run(read())


def test_validate_task_refuses_what_the_backend_cannot_run():
    for bad in [dict(priority=101), dict(priority=-101), dict(queue_name="nowhere"),
                dict(run_after=dt.datetime(2026, 1, 1))]:  # naive
        with pytest.raises(InvalidTask):
            f.noop.using(**bad)
    f.noop.using(priority=100, run_after=timezone.now() + dt.timedelta(hours=1), queue_name="exports")
    assert f.async_meaning.name == "async_meaning"  # async tasks are accepted


@override_settings(TASKS={"default": {"BACKEND": "tasks.backend.FairshareBackend", "QUEUES": ["default", "nowhere"],
                                      "OPTIONS": {"ACOUNT_KWARG": "tenant", "SYSTEM_TASKS": ["tests.nothing"]}}})
def test_misconfiguration_is_reported_by_the_system_checks():
    ids = sorted(message.id for message in default_task_backend.check())
    assert ids == ["tasks.E003", "tasks.E005", "tasks.W001"]
