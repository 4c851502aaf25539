"""Rolling upgrades: a message of an envelope version newer than the worker speaks is parked in the
holding area ("needs a newer worker"), never rejected or dropped, and runs once a worker that
speaks it is up. Producers send FAIRSHARE["ENVELOPE_VERSION"]."""

import pytest
from django.db import transaction
from django_q.tasks import async_task

from budgets.models import Role, UsageDay
from budgets import clock as budget_clock
from budgets import ledger
from scheduling import holding
from scheduling.actions import release_held
from scheduling.envelope import VERSION
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import RUNNER, execute, send
from tests.conftest import fairshare_checks, wait_for
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

NEWER = VERSION + 1  # a version this code does not speak yet (a test seam lets a worker speak it)


def newer(job: str, account: int | None, ref: str) -> dict:
    """A message of the newer version (shaped like the newest this code knows)."""
    return {"v": NEWER, "job": job, "account": account, "ref": ref, "priority": 0}


def speaks(settings, version: int) -> None:
    settings.FAIRSHARE = {**settings.FAIRSHARE, "SPEAKS_ENVELOPE_VERSION": version}


@pytest.fixture
def sent(monkeypatch):
    """What the holding area sends back to the broker (message, queue), instead of sending it."""
    messages = []
    monkeypatch.setattr(holding, "send_message", lambda message, *, queue, name, account: messages.append((message, queue)))
    return messages


def test_a_message_of_a_newer_version_is_parked_with_its_reason_not_rejected(account):
    message = newer("tests.noop", account.pk, "r-1")

    execute(message)

    assert not TaskRun.objects.exists()  # neither run nor recorded as rejected
    parked = DeferredTask.objects.get()
    assert (parked.job, parked.ref, parked.account, parked.queue) == ("tests.noop", "r-1", account, "default")
    assert parked.reason == DeferReason.NEEDS_NEWER_WORKER
    assert parked.get_reason_display() == "Needs a newer worker"
    assert parked.envelope_version == NEWER and parked.message == message


def test_a_newer_message_delivered_twice_is_parked_once(account):
    execute(newer("tests.noop", account.pk, "r-1"))
    execute(newer("tests.noop", account.pk, "r-1"))

    assert DeferredTask.objects.count() == 1


def test_a_newer_message_of_a_shape_v1_cannot_read_is_still_parked_unchanged():
    message = {"v": NEWER, "job": "billing.close_month", "account": None, "ref": {"month": "2026-11"}}

    execute(message)

    parked = DeferredTask.objects.get()
    assert parked.job == "billing.close_month" and parked.account is None and len(parked.ref) == 64
    assert parked.message == message


def test_a_worker_that_does_not_speak_the_version_does_not_release_it(account, sent, django_capture_on_commit_callbacks):
    execute(newer("tests.noop", account.pk, "r-1"))
    execute(newer("scheduling.rollup_task_runs", None, ""))

    with django_capture_on_commit_callbacks(execute=True):
        released = holding.release_due() + holding.release_now(deferred_ids=list(DeferredTask.objects.values_list("pk", flat=True)))

    assert released == 0 and sent == []
    assert DeferredTask.objects.count() == 2


def test_a_worker_that_speaks_the_version_sends_it_back_unchanged(account, settings, sent,
                                                                 django_capture_on_commit_callbacks):
    account_work, system_work = newer("tests.noop", account.pk, "r-1"), newer("scheduling.rollup_task_runs", None, "")
    execute(account_work)
    execute(system_work)
    speaks(settings, NEWER)

    with django_capture_on_commit_callbacks(execute=True):
        released = holding.release_due()  # account work through the budget gate, system work directly

    assert released == 2 and not DeferredTask.objects.exists()
    assert sorted(sent, key=str) == sorted([(account_work, "default"), (system_work, "default")], key=str)


def test_producers_send_the_configured_envelope_version(settings, monkeypatch):
    captured = []
    monkeypatch.setattr("scheduling.broker.async_task", lambda func, message, **kw: captured.append(message))
    send(job="tests.noop", account=1, ref="a")
    speaks(settings, NEWER)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "ENVELOPE_VERSION": NEWER}
    send(job="tests.noop", account=1, ref="b")

    assert [m["v"] for m in captured] == [VERSION, NEWER]


def test_a_producer_cannot_be_told_to_send_a_version_it_does_not_speak(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "ENVELOPE_VERSION": NEWER}

    assert [check_id for check_id, _ in fairshare_checks()] == ["scheduling.E007"]


@pytest.mark.processes
@pytest.mark.django_db(transaction=True)
def test_a_newer_message_waits_for_an_upgraded_worker_and_then_runs_once(account, broker, start_cluster):
    old = start_cluster("default", **broker.env)
    # A newer web (or scheduler) sends a version this worker does not speak yet.
    async_task(RUNNER, newer("tests.noop", account.pk, "newer-account-work"), cluster="default")
    async_task(RUNNER, newer("scheduling.rollup_task_runs", None, ""), cluster="default")
    wait_for(lambda: DeferredTask.objects.filter(reason=DeferReason.NEEDS_NEWER_WORKER).count() == 2, timeout=60,
             message=f"both newer messages parked; worker log:\n{old.log()}")
    # The old worker goes on working (and releasing what it speaks): v1 work runs past them.
    async_task(RUNNER, {"v": 1, "job": "tests.noop", "account": account.pk, "ref": "v1-work"}, cluster="default")
    wait_for(lambda: TaskRun.objects.filter(ref="v1-work", outcome=Outcome.SUCCEEDED).exists(), timeout=60,
             message=f"the v1 task; worker log:\n{old.log()}")
    assert DeferredTask.objects.filter(envelope_version=NEWER).count() == 2
    assert not TaskRun.objects.exclude(ref="v1-work").exists()  # nothing rejected or run

    old.stop()  # the rolling upgrade replaces it with a worker that speaks the newer version
    new = start_cluster("default", FAIRSHARE_TEST_SPEAKS_ENVELOPE_VERSION=str(NEWER), **broker.env)

    wait_for(lambda: TaskRun.objects.filter(job="scheduling.rollup_task_runs", outcome=Outcome.SUCCEEDED).exists()
             and TaskRun.objects.filter(ref="newer-account-work", outcome=Outcome.SUCCEEDED).exists(),
             timeout=60, message=f"both newer messages to run; worker log:\n{new.log()}")
    assert not DeferredTask.objects.exists()
    assert TaskRun.objects.filter(ref="newer-account-work").count() == 1
    assert not TaskRun.objects.filter(outcome=Outcome.REJECTED).exists()


def test_schedules_are_stored_with_the_configured_envelope_version(settings):
    from django_q.models import Schedule

    from scheduling.schedules import sync_schedules

    sync_schedules()
    speaks(settings, NEWER)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "ENVELOPE_VERSION": NEWER}
    counts = sync_schedules()

    assert counts["updated"] == Schedule.objects.count() > 0
    assert all(f"'v': {NEWER}," in row.args for row in Schedule.objects.all())


def test_an_operator_release_of_parked_work_says_it_needs_a_newer_worker(account):
    operator = MembershipFactory(account=account, user=UserFactory(username="acme-operator", is_staff=True),
                                 role=Role.OPERATOR).user
    execute(newer("tests.noop", account.pk, "r-1"))
    parked = DeferredTask.objects.get()

    [result] = release_held(user=operator, deferred_ids=[parked.pk])

    assert not result.ok and f"needs a worker that speaks envelope v{NEWER}" in result.message
    assert DeferredTask.objects.filter(pk=parked.pk).exists()  # still parked, not lost


def test_a_parked_message_is_never_claimed_to_run_in_place_only_sent_back(account, settings):
    # Claims (hand-off, pull) rebuild an envelope from job/account/ref; a parked message must go
    # back to the broker exactly as it came instead: it is never in its account's line.
    execute(newer("tests.noop", account.pk, "r-1"))
    speaks(settings, NEWER)

    with transaction.atomic():
        day = budget_clock.budget_day()
        usage_id = UsageDay.objects.get_or_create(account=account, queue="default", day=day)[0].pk
        assert ledger.claim_for(account_id=account.pk, queue="default", day=day, worker="w:1", yield_to_broker=False,
                                usage=usage_id, reserve_ms=0) is None
    assert DeferredTask.objects.get().claimed_by == ""
