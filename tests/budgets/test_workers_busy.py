"""While every worker is busy (a job sent to the broker has waited for one), new work waits in its
account's line instead of behind it in the broker: the busy workers' loops take it in the fair
order, and the broker holds about as many messages as there are workers (budgets.admission
.admit_at_enqueue, budgets.handoff.release). In-process, with both ledgers; with real workers:
test_handoff.py."""
import datetime as dt

import pytest
from django.utils import timezone

from budgets.admission import admit
from budgets.handoff import fetch_next, release_due
from budgets.ledger.reads import BROKER_WAIT_FORGET_S
from budgets.models import Budget, Reservation, ReservationStatus
from scheduling.envelope import Envelope
from scheduling.models import Backlog, DeferReason, DeferredTask
from scheduling.runtime import enqueue, enqueue_many
from tests.budgets.test_admission import queued_envelopes, usage

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


@pytest.fixture(autouse=True)
def budget(account):
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=50)


def sent_a_while_ago(ref: str, seconds: float = 1) -> None:
    """The job's message has waited `seconds` in the broker without a worker starting it."""
    Reservation.objects.filter(ref=ref).update(created_at=timezone.now() - dt.timedelta(seconds=seconds))


def line(account) -> list[tuple[str, str]]:
    return list(DeferredTask.objects.filter(account=account, in_line_since__isnull=False)
                .order_by("in_line_since", "id").values_list("ref", "reason"))


def start(account, ref: str):
    return admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", estimate_ms=10,
                 worker="w")


def test_new_work_waits_in_line_while_a_job_sent_to_the_broker_waits_for_a_worker(account, other_account):
    Budget.objects.create(account=other_account, queue="default", cpu_seconds_per_day=100, max_concurrent=50)
    assert enqueue(job="tests.noop", account=account.pk, ref="a") is not None
    # A job sent a moment ago is one an idle worker is about to fetch: the next goes to the broker too.
    assert enqueue(job="tests.noop", account=account.pk, ref="b") is not None
    sent_a_while_ago("a")

    # Both accounts have free slots, but no worker took "a": the new work waits in line.
    assert enqueue(job="tests.noop", account=account.pk, ref="c") is None
    assert enqueue(job="tests.noop", account=account.pk, ref="d") is None
    assert enqueue(job="tests.noop", account=other_account.pk, ref="x") is None
    assert line(account) == [("c", DeferReason.WORKERS_BUSY), ("d", DeferReason.QUEUED_BEHIND)]
    assert line(other_account) == [("x", DeferReason.WORKERS_BUSY)]
    assert [e["ref"] for e in queued_envelopes()] == ["a", "b"]  # the broker holds what it held
    assert Backlog.objects.get(account=account).in_line == 2  # counted in line (by reason: those out of it)
    assert usage(account).deferrals == 2
    # Nothing is released to the broker behind "a" either ...
    assert release_due() == 0
    assert fetch_next(queue="default", worker="w1") is None
    # ... until the broker's jobs started: then the workers' loops take the line's work, in the
    # fair order (the other account has fewer slots in use).
    assert start(account, "a").admitted and start(account, "b").admitted
    assert fetch_next(queue="default", worker="w1").envelope.ref == "x"
    assert fetch_next(queue="default", worker="w2").envelope.ref == "c"


def test_an_idle_workers_pulse_still_releases_held_work_while_the_broker_seems_to_wait(
    account, django_capture_on_commit_callbacks,
):
    # "a" waits in the broker, or its message is gone; a worker that is idle asks for work anyway.
    enqueue(job="tests.noop", account=account.pk, ref="a")
    sent_a_while_ago("a")
    enqueue_many(job="tests.noop", work=[(account.pk, "b"), (account.pk, "c")])
    assert line(account) == [("b", DeferReason.WORKERS_BUSY), ("c", DeferReason.QUEUED_BEHIND)]

    with django_capture_on_commit_callbacks(execute=True):
        assert release_due(idle_workers={"default": 1}) == 1
    assert [e["ref"] for e in queued_envelopes()] == ["a", "b"]
    assert line(account) == [("c", DeferReason.QUEUED_BEHIND)]


def test_a_message_that_waited_a_minute_is_taken_for_lost_and_new_work_goes_to_the_broker(account):
    enqueue(job="tests.noop", account=account.pk, ref="a")
    sent_a_while_ago("a", seconds=BROKER_WAIT_FORGET_S + 1)

    assert enqueue(job="tests.noop", account=account.pk, ref="b") is not None
    assert [e["ref"] for e in queued_envelopes()] == ["a", "b"]
    assert not DeferredTask.objects.exists()
    assert list(Reservation.objects.order_by("id").values_list("ref", "status")) == [
        ("a", ReservationStatus.DISPATCHED), ("b", ReservationStatus.DISPATCHED)]


def test_the_reasons_of_a_full_account_come_before_busy_workers(account, budget):
    budget.max_concurrent = 1
    budget.save()
    enqueue(job="tests.noop", account=account.pk, ref="a")
    sent_a_while_ago("a")

    assert enqueue(job="tests.noop", account=account.pk, ref="b") is None
    assert line(account) == [("b", DeferReason.CONCURRENCY_CAP)]  # what it waits for first: its own slot
