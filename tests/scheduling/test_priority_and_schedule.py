"""`enqueue(priority=, run_after=)`: an account's held work goes highest priority first (oldest
first within one), and work with a time before which it may not run waits in the holding area
("scheduled") until then, holding no slot and nothing in the broker."""
import datetime as dt

import pytest
from django_q.models import OrmQ

from budgets.models import Budget, Reservation
from scheduling import clock
from scheduling.envelope import Envelope
from scheduling.holding import release_due
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue, enqueue_many, execute

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def test_work_enqueued_to_run_later_waits_scheduled_until_then_and_then_goes(
        account, settings, django_capture_on_commit_callbacks):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=2)
    later = clock.now() + dt.timedelta(hours=2)

    assert enqueue(job="tests.noop", account=account.pk, ref="later", run_after=later) is None

    held = DeferredTask.objects.get(ref="later")
    assert (held.reason, held.eligible_at, held.get_reason_display()) == (
        DeferReason.SCHEDULED, later, "Scheduled for later")
    assert not OrmQ.objects.exists() and not Reservation.objects.exists()  # no slot, not in the broker
    assert release_due() == 0  # not yet

    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": 2 * 3600 + 1}
    with django_capture_on_commit_callbacks(execute=True):  # released work is sent once that commits
        assert release_due() == 1
    assert not DeferredTask.objects.exists() and OrmQ.objects.count() == 1
    assert Reservation.objects.filter(ref="later").exists()  # released into a free slot


@pytest.mark.parametrize("queue", ["default", "exports"])
def test_work_of_a_brand_new_account_held_for_a_time_goes_at_that_time(
        account, settings, django_capture_on_commit_callbacks, queue):
    # No Budget row yet on any queue: its plan's rows are made under its lock, which the release
    # takes; the release must find its line all the same.
    assert not Budget.objects.filter(account=account).exists()
    later = clock.now() + dt.timedelta(seconds=2)
    job = "tests.noop" if queue == "default" else "tests.hold_exports_worker"
    enqueue(job=job, account=account.pk, ref="new-account", run_after=later)

    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": 3}
    with django_capture_on_commit_callbacks(execute=True):
        assert release_due() == 1
    assert not DeferredTask.objects.exists() and OrmQ.objects.count() == 1
    assert Reservation.objects.filter(ref="new-account", queue=queue).exists()
    assert Budget.objects.filter(account=account, queue=queue).exists()  # its plan's defaults, made then


def test_a_run_after_that_has_passed_is_sent_at_once(account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=2)

    assert enqueue(job="tests.noop", account=account.pk, ref="past",
                   run_after=clock.now() - dt.timedelta(seconds=1)) is not None
    assert not DeferredTask.objects.exists()


def test_system_work_can_be_scheduled_too(settings, django_capture_on_commit_callbacks):
    later = clock.now() + dt.timedelta(minutes=5)

    assert enqueue(job="scheduling.rollup_task_runs", account=None, ref="nightly", run_after=later) is None
    assert DeferredTask.objects.get().reason == DeferReason.SCHEDULED

    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": 301}
    with django_capture_on_commit_callbacks(execute=True):
        assert release_due() == 1
    assert OrmQ.objects.count() == 1


@pytest.mark.parametrize("priority", [101, -101, 2.5, "high"])
def test_a_priority_outside_minus_100_to_100_is_refused_and_nothing_is_enqueued(account, priority):
    with pytest.raises(ValueError, match="priority must be an integer from -100 to 100"):
        enqueue(job="tests.noop", account=account.pk, ref="bad", priority=priority)
    with pytest.raises(ValueError, match="priority must be an integer"):
        enqueue_many(job="tests.noop", work=[(account.pk, "bad")], priority=priority)
    assert not DeferredTask.objects.exists() and not OrmQ.objects.exists() and not Reservation.objects.exists()


def test_an_accounts_held_work_goes_highest_priority_first_then_oldest(account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    assert enqueue(job="tests.noop", account=account.pk, ref="running") is not None  # takes the one slot
    for ref, priority in (("low-1", -10), ("normal-1", 0), ("high-1", 50), ("normal-2", 0), ("high-2", 50)):
        assert enqueue(job="tests.noop", account=account.pk, ref=ref, priority=priority) is None

    execute(Envelope(job="tests.noop", account=account.pk, ref="running").to_message())

    # The settling run handed its slot on, and each next one too, in priority order.
    runs = list(TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).order_by("started_at").values_list("ref", flat=True))
    assert runs == ["running", "high-1", "high-2", "normal-1", "normal-2", "low-1"]


def test_a_job_held_again_after_it_was_sent_keeps_its_priority(account):
    """The envelope carries it (v2): a job refused at its start is held at the priority it was
    enqueued with, not at 0."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    assert enqueue(job="tests.noop", account=account.pk, ref="first") is not None
    # Another job's message arrives while the first holds the only slot (an operator's release, a
    # duplicate delivery): its admission holds it.
    execute(Envelope(job="tests.noop", account=account.pk, ref="urgent", priority=70).to_message())

    held = DeferredTask.objects.get(ref="urgent")
    assert (held.reason, held.priority) == (DeferReason.CONCURRENCY_CAP, 70)
