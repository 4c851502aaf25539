"""Admission, settlement, reclaim and release: the ledger and the holding area (in-process)."""
import datetime as dt

import pytest
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.admission import admit, admit_at_enqueue
from scheduling.holding import release_due  # the pulse's tick
from budgets.reclaim import reclaim_expired
from budgets.running import reservation_grow
from budgets.settlement import settle
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


@pytest.fixture
def budget(account):
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)


def envelope(account, ref: str, job: str = "tests.noop") -> Envelope:
    return Envelope(job=job, account=account.pk, ref=ref)


def meter(cpu_ms: int, wall_ms: int = 0, db_ms: float = 0, storage_ms: float = 0) -> Meter:
    m = Meter(cpu_ms=cpu_ms, wall_ms=wall_ms, db_wait_ms=db_ms, storage_wait_ms=storage_ms)
    m._stopped = True
    return m


def usage(account) -> UsageDay:
    return UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())


def queued_envelopes() -> list[dict]:
    return [SignedPackage.loads(q.payload)["args"][0] for q in OrmQ.objects.order_by("id")]


def test_admission_reserves_a_step_of_cpu_and_takes_the_only_slot(account, budget, settings):
    first = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=300, worker="w")
    # At least one reservation step (1 s), more if the job's estimate says so: the run may spend
    # what it reserved, not the account's whole remaining budget.
    assert first.admitted and first.allowance_ms == 1000
    assert usage(account).cpu_reserved_ms == 1000
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=10, max_concurrent=1)
    big = admit(envelope=envelope(account, "big", job="exports.build"), queue="exports", estimate_ms=2500,
                worker="w")
    assert big.allowance_ms == 2500

    second = admit(envelope=envelope(account, "b"), queue="default", estimate_ms=300, worker="w")
    assert not second.admitted and second.reason == DeferReason.CONCURRENCY_CAP
    held = DeferredTask.objects.get()
    assert (held.ref, held.reason) == ("b", DeferReason.CONCURRENCY_CAP)
    assert usage(account).deferrals == 1


def test_settlement_charges_measured_cpu_once_and_releases_the_oldest_held_job(
    account, budget, django_capture_on_commit_callbacks,
):
    running = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=300, worker="w")
    admit(envelope=envelope(account, "b"), queue="default", estimate_ms=300, worker="w")
    admit(envelope=envelope(account, "c"), queue="default", estimate_ms=300, worker="w")

    with django_capture_on_commit_callbacks(execute=True):
        assert settle(slot_id=running.slot_id, account_id=account.pk, queue="default",
                      meter=meter(cpu_ms=1234, wall_ms=2000, db_ms=12.4, storage_ms=7.6))
    # Exactly once: a second settlement of the same run changes nothing.
    assert not settle(slot_id=running.slot_id, account_id=account.pk, queue="default",
                      meter=meter(cpu_ms=1234))

    row = usage(account)
    assert (row.cpu_used_ms, row.cpu_reserved_ms, row.wall_ms, row.db_wait_ms, row.storage_wait_ms, row.runs) == (
        1234, 0, 2000, 12, 8, 1)
    # The oldest held job went back to the broker, holding the freed slot until it starts.
    assert [e["ref"] for e in queued_envelopes()] == ["b"]
    assert list(Reservation.objects.values_list("ref", "status")) == [("b", ReservationStatus.DISPATCHED)]
    assert list(DeferredTask.objects.values_list("ref", flat=True)) == ["c"]


def test_exhausted_budget_holds_work_until_the_next_budget_day(
    account, budget, settings, django_capture_on_commit_callbacks,
):
    run = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=300, worker="w")
    settle(slot_id=run.slot_id, account_id=account.pk, queue="default", meter=meter(cpu_ms=10_500))

    refused = admit(envelope=envelope(account, "b"), queue="default", estimate_ms=300, worker="w")
    assert refused.reason == DeferReason.BUDGET_EXHAUSTED
    assert refused.eligible_at == clock.next_reset()
    # The enqueue-time check holds new work too, instead of ringing the doorbell.
    assert enqueue(job="tests.noop", account=account.pk, ref="c") is None
    assert OrmQ.objects.count() == 0
    assert set(DeferredTask.objects.values_list("ref", "reason")) == {
        ("b", DeferReason.BUDGET_EXHAUSTED), ("c", DeferReason.BUDGET_EXHAUSTED)}

    assert release_due() == 0  # still today
    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": 24 * 3600}  # tomorrow
    with django_capture_on_commit_callbacks(execute=True):
        assert release_due() == 1  # one slot: the oldest goes first
    assert [e["ref"] for e in queued_envelopes()] == ["b"]
    fresh = admit(envelope=envelope(account, "b"), queue="default", estimate_ms=300, worker="w")
    assert fresh.admitted and fresh.allowance_ms == 1000


def test_enqueue_waits_behind_held_work_of_the_same_account(account, other_account, budget):
    admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    admit(envelope=envelope(account, "b"), queue="default", estimate_ms=10, worker="w")
    assert not admit_at_enqueue(envelope=envelope(account, "c"), queue="default")
    # It joins the line behind "b", held for the first cause the rule finds: the cap (before "behind
    # its line": budgets.standing.refusal).
    c = DeferredTask.objects.get(ref="c")
    assert c.reason == DeferReason.CONCURRENCY_CAP and c.in_line_since >= DeferredTask.objects.get(ref="b").in_line_since
    # Another account is not affected.
    assert admit_at_enqueue(envelope=envelope(other_account, "x"), queue="default")


def test_reclaim_gives_back_a_dead_runs_slot_and_charges_what_it_reported(
    account, budget, django_capture_on_commit_callbacks,
):
    run = TaskRun.objects.create(account=account, job="tests.noop", ref="a", started_at=timezone.now())
    dead = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=300, run=run, worker="w")
    admit(envelope=envelope(account, "b"), queue="default", estimate_ms=300, worker="w")
    Reservation.objects.filter(pk=dead.slot_id).update(
        cpu_reported_ms=700, lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    with django_capture_on_commit_callbacks(execute=True):
        assert reclaim_expired() == 1
    assert reclaim_expired() == 0
    row = usage(account)
    assert (row.cpu_used_ms, row.cpu_reserved_ms, row.runs) == (700, 0, 1)
    run.refresh_from_db()
    assert (run.outcome, run.cpu_ms) == (Outcome.LOST, 700)
    assert [e["ref"] for e in queued_envelopes()] == ["b"]
    assert Reservation.objects.get(ref="b").status == ReservationStatus.DISPATCHED

    # The "dead" run was only slow: its late settlement charges the remainder, nothing twice.
    assert Reservation.objects.get(pk=dead.slot_id).status == ReservationStatus.RECLAIMED
    settle(slot_id=dead.slot_id, account_id=account.pk, queue="default", meter=meter(cpu_ms=900))
    row = usage(account)
    assert (row.cpu_used_ms, row.cpu_reserved_ms, row.runs) == (900, 0, 1)


def test_queues_have_independent_budgets(account, budget):
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=10, max_concurrent=1)
    assert admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w").admitted
    assert admit(envelope=envelope(account, "e", job="exports.build"), queue="exports", estimate_ms=10,
                 worker="w").admitted


def test_budget_defaults_come_from_the_plan_tier(account, settings):
    admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    budget = Budget.objects.get(account=account, queue="default")
    expected = settings.FAIRSHARE["PLAN_BUDGETS"][account.plan]["default"]
    assert (budget.cpu_seconds_per_day, budget.max_concurrent) == (expected["cpu_seconds_per_day"], expected["max_concurrent"])


# --- The daily cap across concurrent runs ------------------------------------------------------

def test_concurrent_runs_of_one_account_never_reserve_more_than_it_has_left(
    account, django_capture_on_commit_callbacks,
):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=2, max_concurrent=3)
    first = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    second = admit(envelope=envelope(account, "b"), queue="default", estimate_ms=1500, worker="w")
    assert (first.allowance_ms, second.allowance_ms) == (1000, 1000)  # the second gets what is left
    # A third run could take a slot, but the budget is all reserved: it waits for the others.
    third = admit(envelope=envelope(account, "c"), queue="default", estimate_ms=10, worker="w")
    assert (third.admitted, third.reason) == (False, DeferReason.BUDGET_RESERVED)
    assert reservation_grow(slot_id=first.slot_id, cpu_ms=900, want_ms=1000) == 0

    # The first gives back what it did not use: the held job runs with that.
    with django_capture_on_commit_callbacks(execute=True):
        settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(cpu_ms=400))
    assert [e["ref"] for e in queued_envelopes()] == ["c"]
    again = admit(envelope=envelope(account, "c"), queue="default", estimate_ms=10, worker="w")
    assert again.allowance_ms == 600
    assert reservation_grow(slot_id=second.slot_id, cpu_ms=990, want_ms=1000) == 0
    row = usage(account)
    assert (row.cpu_used_ms, row.cpu_reserved_ms) == (400, 1600)


def test_a_run_grows_its_reservation_while_the_account_has_budget_left(account, budget):
    run = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    assert reservation_grow(slot_id=run.slot_id, cpu_ms=800, want_ms=5000) == 5000
    assert reservation_grow(slot_id=run.slot_id, cpu_ms=5800, want_ms=5000) == 4000  # 10 s in all
    assert reservation_grow(slot_id=run.slot_id, cpu_ms=9900, want_ms=5000) == 0
    reservation = Reservation.objects.get(pk=run.slot_id)
    assert (reservation.cpu_reserved_ms, reservation.cpu_reported_ms) == (10_000, 9900)
    assert usage(account).cpu_reserved_ms == 10_000


def test_a_run_stopped_by_the_cap_waits_for_tomorrow_when_nothing_is_left(account, budget):
    run = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10_000, worker="w")
    settle(slot_id=run.slot_id, account_id=account.pk, queue="default", meter=meter(cpu_ms=10_100),
           cap_hit=True, envelope=envelope(account, "a"))
    held = DeferredTask.objects.get()
    assert (held.ref, held.reason, held.eligible_at) == ("a", DeferReason.BUDGET_EXHAUSTED, clock.next_reset())
    assert usage(account).cap_hits == 1


# --- Slots from enqueue to start ----------------------------------------------------------------

def test_a_sent_job_holds_a_slot_until_it_starts_so_a_burst_waits_in_the_holding_area(
    account, budget, django_capture_on_commit_callbacks,
):
    assert enqueue(job="tests.noop", account=account.pk, ref="a") is not None
    assert Reservation.objects.get().status == ReservationStatus.DISPATCHED
    # The only slot is taken by the job in the broker: the rest of the burst never reaches it.
    assert enqueue(job="tests.noop", account=account.pk, ref="b") is None
    assert enqueue(job="tests.noop", account=account.pk, ref="c") is None
    # Both for the cause (the cap comes before "behind its line" in budgets.standing.refusal).
    assert list(DeferredTask.objects.values_list("ref", "reason")) == [
        ("b", DeferReason.CONCURRENCY_CAP), ("c", DeferReason.CONCURRENCY_CAP)]
    assert [e["ref"] for e in queued_envelopes()] == ["a"]

    # When it starts, the run takes over its own slot (no deferral), and settling releases the next.
    run = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    assert run.admitted
    assert Reservation.objects.get().status == ReservationStatus.ACTIVE
    with django_capture_on_commit_callbacks(execute=True):
        settle(slot_id=run.slot_id, account_id=account.pk, queue="default", meter=meter(cpu_ms=5))
    assert [e["ref"] for e in queued_envelopes()] == ["a", "b"]
    assert list(Reservation.objects.values_list("ref", "status")) == [("b", ReservationStatus.DISPATCHED)]
    # A duplicate delivery of the finished job finds no slot of its own and none free: it waits.
    duplicate = admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10, worker="w")
    assert duplicate.reason == DeferReason.CONCURRENCY_CAP


def test_the_slot_of_a_lost_message_comes_back_after_the_dispatch_lease(
    account, budget, django_capture_on_commit_callbacks,
):
    assert enqueue(job="tests.noop", account=account.pk, ref="lost") is not None
    assert enqueue(job="tests.noop", account=account.pk, ref="next") is None
    OrmQ.objects.all().delete()  # the broker lost the message
    assert reclaim_expired() == 0  # not before its lease
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    with django_capture_on_commit_callbacks(execute=True):
        assert reclaim_expired() == 1
    assert [e["ref"] for e in queued_envelopes()] == ["next"]
    assert list(Reservation.objects.values_list("ref", "status")) == [("next", ReservationStatus.DISPATCHED)]
    assert usage(account).runs == 0  # nothing ran, nothing is charged
    # ...and the lost job is not lost: it waits in the holding area to be sent again.
    assert list(DeferredTask.objects.values_list("ref", "reason")) == [("lost", DeferReason.MESSAGE_LOST)]


def test_a_job_sent_again_before_it_started_goes_out_on_the_slot_it_holds(account, budget):
    assert enqueue(job="tests.noop", account=account.pk, ref="a") is not None
    # A reconciler rings the doorbell again (the first message may be lost): no second slot, no hold.
    assert enqueue(job="tests.noop", account=account.pk, ref="a") is not None
    assert list(Reservation.objects.values_list("ref", "status")) == [("a", ReservationStatus.DISPATCHED)]
    assert not DeferredTask.objects.exists()
    assert [e["ref"] for e in queued_envelopes()] == ["a", "a"]


def test_one_slot_too_many_dispatched_by_racing_enqueues_still_runs_one_job_at_a_time(account, budget):
    # Two requests enqueue at the same moment: both read one free slot without a lock and both
    # send their job. The cap is on running jobs, and admission (under the lock) enforces it.
    assert admit_at_enqueue(envelope=envelope(account, "a"), queue="default")
    Reservation.objects.create(account=account, queue="default", day=clock.budget_day(), job="tests.noop",
                               ref="b", status=ReservationStatus.DISPATCHED,
                               lease_expires_at=timezone.now() + dt.timedelta(minutes=5))
    assert admit(envelope=envelope(account, "a"), queue="default", estimate_ms=10,
                 worker="w").admitted
    racer = admit(envelope=envelope(account, "b"), queue="default", estimate_ms=10, worker="w")
    assert racer.reason == DeferReason.CONCURRENCY_CAP
    assert list(Reservation.objects.values_list("ref", "status")) == [("a", ReservationStatus.ACTIVE)]
    assert DeferredTask.objects.get().ref == "b"
