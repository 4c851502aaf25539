"""Operators and Django task calls: the admin shows an account's calls (why a READY one waits, its
redacted errors and arguments) to its members only, and retry and cancel are services that check
the role, report per item and write Django's admin log."""
import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.test import override_settings
from django.utils import timezone
from django_q.models import OrmQ

from budgets import clock
from budgets.models import Budget, Role, UsageDay
from scheduling.models import DeferredTask
from scheduling.pausing import pause, resume
from tasks.compat import TaskResultStatus
from tasks.exceptions import Cancelled
from tasks.models import TaskCall
from tasks.operations import call_cancel, call_retry
from tests.factories import MembershipFactory, UserFactory
from tests.tasks import functions as f

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

SYSTEM = {"default": {"BACKEND": "tasks.backend.FairshareBackend", "QUEUES": ["default", "exports"],
                      "OPTIONS": {"SYSTEM_TASKS": ["tests.tasks.functions.system_chore"]}}}


def _log(result) -> list[str]:
    return list(LogEntry.objects.filter(object_id=result.id).values_list("change_message", flat=True))


def _failed(result) -> None:
    TaskCall.objects.filter(pk=result.id).update(
        status=TaskResultStatus.FAILED, attempt_count=5, finished_at=timezone.now(), workers="w:1\n" * 5,
        errors=[{"exception_class_path": "builtins.ValueError", "traceback": "ValueError: no\n"}])


def test_retry_sends_a_failed_call_again_with_fresh_attempts(account, operator, django_capture_on_commit_callbacks):
    result = f.noop.enqueue(account=account)
    _failed(result)
    OrmQ.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        [done] = call_retry(user=operator, call_ids=[result.id])
    assert done.ok and done.message == "queued again"
    result.refresh()
    call = TaskCall.objects.get(pk=result.id)
    assert result.status == TaskResultStatus.READY and result.finished_at is None
    assert (call.attempt_count, call.attempt_limit) == (5, 10)
    assert result.errors[0].exception_class is ValueError  # the history stays
    assert OrmQ.objects.count() == 1
    assert _log(result) == ["Retried (was failed)"]


def test_cancel_fails_a_waiting_call_and_takes_it_out_of_the_holding_area(
        account, operator, django_capture_on_commit_callbacks):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=60, max_concurrent=1)
    with django_capture_on_commit_callbacks(execute=True):
        f.noop.enqueue(account=account)  # takes the one slot
        second = f.noop.enqueue(account=account)  # the cap holds it
    assert DeferredTask.objects.filter(ref=second.id).exists()

    [done] = call_cancel(user=operator, call_ids=[second.id])
    assert done.ok
    second.refresh()
    assert second.status == TaskResultStatus.FAILED and second.errors[0].exception_class is Cancelled
    assert "cancelled by acme-operator before it ran" in second.errors[0].traceback
    assert not DeferredTask.objects.filter(ref=second.id).exists()
    assert _log(second) == ["Cancelled"]


def test_each_item_is_checked_against_its_account_and_state(account, other_account, operator, viewer):
    ready, failed, elsewhere = (f.noop.enqueue(account=account), f.noop.enqueue(account=account),
                                f.noop.enqueue(account=other_account))
    _failed(failed)
    _failed(elsewhere)
    results = call_retry(user=operator, call_ids=[ready.id, failed.id, elsewhere.id])
    assert [(r.ok, r.message) for r in results] == [
        (False, "it is ready; only failed task calls can be retried"),
        (True, "queued again"),
        (False, "not found"),  # another tenant's call looks missing
    ]
    TaskCall.objects.filter(pk=failed.id).update(status=TaskResultStatus.RUNNING)
    [running] = call_cancel(user=operator, call_ids=[failed.id])
    assert (running.ok, running.message) == (
        False, "it is running; only a task call that has not started can be cancelled")
    [refused] = call_cancel(user=viewer, call_ids=[ready.id])
    assert (refused.ok, refused.message) == (False, "your role (viewer) may not do this; it needs operator")
    assert TaskCall.objects.get(pk=elsewhere.id).status == TaskResultStatus.FAILED


@override_settings(TASKS=SYSTEM)
def test_system_calls_belong_to_superusers(account, operator, root):
    result = f.system_chore.enqueue()
    [refused] = call_cancel(user=operator, call_ids=[result.id])
    assert (refused.ok, refused.message) == (False, "only a superuser may do this")
    [done] = call_cancel(user=root, call_ids=[result.id])
    assert done.ok


def test_the_admin_shows_a_members_calls_why_they_wait_and_their_errors_redacted(
        client, account, other_account, operator, django_capture_on_commit_callbacks):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=60, max_concurrent=1)
    with django_capture_on_commit_callbacks(execute=True):
        f.echo.enqueue("planted.person@example.com", account=account)  # takes the one slot
        held = f.noop.enqueue(account=account)
        hidden = f.noop.enqueue(account=other_account)
        failed = f.noop.enqueue(account=account)
    _failed(failed)
    client.force_login(operator)
    operator.user_permissions.add(Permission.objects.get(codename="view_taskcall"))

    page = client.get("/admin/tasks/taskcall/").content.decode()
    assert held.id in page and hidden.id not in page and "globex" not in page
    assert "Account at its concurrency cap, when one of its runs ends" in page
    assert client.get(f"/admin/tasks/taskcall/{hidden.id}/change/").status_code == 404
    detail = client.get(f"/admin/tasks/taskcall/{failed.id}/change/").content.decode()
    assert "builtins.ValueError" in detail and "ValueError: no" in detail
    shown = client.get(f"/admin/tasks/taskcall/{TaskCall.objects.get(task_path__endswith='.echo').pk}/change/")
    assert "planted.person" not in shown.content.decode()


def test_a_paused_accounts_calls_wait_until_resumed_and_the_admin_says_so(
        client, account, operator, django_capture_on_commit_callbacks):
    assert pause(user=operator, account=account).ok
    with django_capture_on_commit_callbacks(execute=True):
        result = f.noop.enqueue(account=account)
    assert DeferredTask.objects.get(ref=result.id).reason == "paused" and not OrmQ.objects.exists()
    client.force_login(operator)
    operator.user_permissions.add(Permission.objects.get(codename="view_taskcall"))
    assert "Paused by an operator, when an operator resumes it" in client.get("/admin/tasks/taskcall/").content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        assert resume(user=operator, account=account).ok
    assert not DeferredTask.objects.filter(ref=result.id).exists() and OrmQ.objects.count() == 1


def test_a_call_held_until_its_accounts_budget_day_says_so(
        client, account, operator, django_capture_on_commit_callbacks):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1, max_concurrent=2)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day(), cpu_used_ms=1000)
    with django_capture_on_commit_callbacks(execute=True):
        result = f.noop.enqueue(account=account)
    assert DeferredTask.objects.get(ref=result.id).reason == "budget_exhausted"
    client.force_login(operator)
    operator.user_permissions.add(Permission.objects.get(codename="view_taskcall"))
    page = client.get(f"/admin/tasks/taskcall/{result.id}/change/").content.decode()
    assert f"Daily CPU budget exhausted, eligible from {clock.next_reset():%Y-%m-%d %H:%M} UTC (in " in page


@pytest.fixture
def viewer(account):
    return MembershipFactory(account=account, user=UserFactory(username="acme-viewer", is_staff=True),
                             role=Role.VIEWER).user
