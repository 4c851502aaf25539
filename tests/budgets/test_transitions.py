"""Each slot transition of budgets.ledger (the map in budgets/ledger/__init__.py), run on PostgreSQL
by itself: the state it moves the slot from and to, what it charges or reserves on the day's usage
row, and the named result it returns; each is one named statement of budgets/ledger/queries.sql or one
ORM write. (The rules that call them: test_admission, test_claims, test_handoff; their costs on large
tables: tests/scheduling/test_held_work_cost.py; the statements themselves: test_queries.py.)"""
import datetime as dt

import pytest
from django.db import connection, transaction
from django.utils import timezone

from budgets import clock, ledger
from budgets.ledger import PassOn
from budgets.models import Budget, Reservation, ReservationStatus as S, UsageDay
from scheduling import holding
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.services import RunEnd, task_run_new

pytestmark = pytest.mark.django_db

QUEUE = "default"


@pytest.fixture
def day():
    return clock.budget_day()


@pytest.fixture
def acme(account):
    Budget.objects.create(account=account, queue=QUEUE, cpu_seconds_per_day=10, max_concurrent=2)
    return account


def job(account, ref: str) -> Envelope:
    return Envelope(job="tests.noop", account=account.pk, ref=ref)


def state(account, day, envelope=None):
    with transaction.atomic():
        assert ledger.lock(account_id=account.pk, queue=QUEUE)
        return ledger.standing(account_id=account.pk, queue=QUEUE, day=day, envelope=envelope)


def usage(account, day) -> UsageDay:
    return UsageDay.objects.get(account=account, queue=QUEUE, day=day)


def active(account, day, ref: str, reserve_ms: int = 1000) -> int:
    """(none) -> ACTIVE through `activate`, its run inserted: a slot running `ref`."""
    run = task_run_new(job="tests.noop", queue=QUEUE, account_id=account.pk, ref=ref)
    return ledger.activate(envelope=job(account, ref), queue=QUEUE, state=state(account, day), day=day, own=None,
                           reserve_ms=reserve_ms, run=run, worker="w")


def test_standing_is_read_by_column_name(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day, cpu_used_ms=2500, cpu_reserved_ms=500)
    s = state(acme, day)
    assert (s.cpu_limit_ms, s.cpu_used_ms, s.cpu_reserved_ms, s.unreserved_ms) == (10_000, 2500, 500, 7000)
    assert (s.max_concurrent, s.in_flight, s.active, s.in_line, s.paused, s.weight) == (2, 0, 0, False, False, 1)
    assert ledger.standing(account_id=acme.pk, queue="exports", day=day) is None  # no Budget row there


def test_the_lock_the_fair_order_and_the_brokers_question(acme, other_account, day):
    assert not ledger.lock(account_id=acme.pk, queue="exports")  # no Budget row there
    Budget.objects.create(account=other_account, queue=QUEUE, cpu_seconds_per_day=10, max_concurrent=2, weight=2)
    for who in (acme, other_account):
        holding.hold(envelope=job(who, f"held-{who.pk}"), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                     eligible_at=holding.clock.now())
    ledger.dispatch(envelope=job(acme, "sent"), queue=QUEUE, day=day)
    # Fewest slots in use for the weight first: the other account (0 of weight 2), then acme (1 of 1).
    assert ledger.ready_accounts(queue=QUEUE) == [ledger.Ready(other_account.pk, QUEUE, 0.0),
                                                  ledger.Ready(acme.pk, QUEUE, 1.0)]
    assert ledger.broker_waiting(queue=QUEUE) is False  # sent just now: not waiting yet
    Reservation.objects.update(created_at=timezone.now() - dt.timedelta(seconds=5))
    assert ledger.broker_waiting(queue=QUEUE) is True
    with transaction.atomic():  # a claim that yields to the broker takes nothing
        usage_id = ledger.usage_id(state(acme, day), account_id=acme.pk, queue=QUEUE, day=day)
        assert ledger.claim_for(account_id=acme.pk, queue=QUEUE, day=day, worker="w", yield_to_broker=True,
                                usage=usage_id, reserve_ms=100) is None
    assert usage(acme, day).cpu_reserved_ms == 0


def test_dispatch_redispatch_drop_and_undispatch(acme, day):
    slot = ledger.dispatch(envelope=job(acme, "a"), queue=QUEUE, day=day)
    row = Reservation.objects.get(pk=slot)
    assert (row.status, row.ref, row.cpu_reserved_ms) == (S.DISPATCHED, "a", 0)
    Reservation.objects.filter(pk=slot).update(lease_expires_at=timezone.now())
    ledger.redispatch(slot_id=slot)
    assert Reservation.objects.get(pk=slot).lease_expires_at > timezone.now() + dt.timedelta(seconds=60)
    ledger.drop(slot_id=slot)
    assert not Reservation.objects.exists()
    ledger.dispatch_many(envelopes=[job(acme, "b"), job(acme, "c")], queue=QUEUE, day=day)
    ledger.undispatch(envelope=job(acme, "b"), queue=QUEUE)
    assert list(Reservation.objects.values_list("ref", "status")) == [("c", S.DISPATCHED)]


@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_release_takes_the_lines_first_claimable_jobs_out_with_a_slot_each_and_no_more(acme, day, plan):
    """(held jobs) -> DISPATCHED: in line order, past a live claim and an expired one whose slot
    stands, never more than asked (a re-scanned subquery would skip the rows it deleted and take more:
    a plan does that for a holding area the statistics think empty)."""
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE scheduling_deferredtask")
    for i in range(8):
        holding.hold(envelope=job(acme, f"h{i}"), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                     eligible_at=holding.clock.now())
    gone = holding.clock.now() - dt.timedelta(minutes=1)
    DeferredTask.objects.filter(ref="h0").update(claimed_by="w", claim_expires_at=gone + dt.timedelta(hours=1))
    DeferredTask.objects.filter(ref="h1").update(claimed_by="dead", claim_expires_at=gone)
    ledger.dispatch(envelope=job(acme, "h1"), queue=QUEUE, day=day)  # the dead claimant's slot stands
    with connection.cursor() as cursor:
        cursor.execute(f"SET plan_cache_mode = {plan}")
    try:
        with transaction.atomic():
            taken = [[held.ref for held in ledger.release(account_id=acme.pk, queue=QUEUE, day=day, limit=limit)]
                     for limit in (1, 2, 1, 1, 1, 1)]
    finally:
        with connection.cursor() as cursor:
            cursor.execute("RESET plan_cache_mode")
    assert taken == [["h2"], ["h3", "h4"], ["h5"], ["h6"], ["h7"], []]
    assert set(DeferredTask.objects.values_list("ref", flat=True)) == {"h0", "h1"}
    assert sorted(Reservation.objects.filter(status=S.DISPATCHED).values_list("ref", flat=True)) == [
        "h1", *(f"h{i}" for i in range(2, 8))]


def test_dispatch_or_hold_sends_holds_in_line_or_leaves_it_to_the_lock(acme, day, beating_workers):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    sent = ledger.dispatch_or_hold(envelope=job(acme, "a"), queue=QUEUE, day=day)
    assert sent == (True, Reservation.objects.get(ref="a", status=S.DISPATCHED).pk, True)  # a slot, sent
    holding.hold(envelope=job(acme, "held"), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                 eligible_at=holding.clock.now())
    assert ledger.dispatch_or_hold(envelope=job(acme, "b"), queue=QUEUE, day=day) == (True, None, True)  # in line
    assert DeferredTask.objects.get(ref="b").reason == DeferReason.QUEUED_BEHIND
    assert usage(acme, day).deferrals == 1
    Budget.objects.filter(account=acme).update(rate_starts=5)
    assert ledger.dispatch_or_hold(envelope=job(acme, "c"), queue=QUEUE, day=day) == (False, None, True)  # the lock's
    beating_workers(1)  # one worker, and the slot "a" takes it: none is free
    assert ledger.dispatch_or_hold(envelope=job(acme, "d"), queue=QUEUE, day=day) == (False, None, False)
    Budget.objects.filter(account=acme).update(rate_starts=None)
    assert ledger.dispatch_or_hold(envelope=job(acme, "e"), queue=QUEUE, day=day) == (True, None, False)
    assert DeferredTask.objects.get(ref="e").reason == DeferReason.QUEUED_BEHIND  # (its line's reason first)


def test_activate_in_each_of_its_shapes(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    # Its own dispatched slot, its run given.
    own = ledger.dispatch(envelope=job(acme, "own"), queue=QUEUE, day=day)
    run = task_run_new(job="tests.noop", queue=QUEUE, account_id=acme.pk, ref="own")
    run.started_at = timezone.now()
    run.save()
    assert ledger.activate(envelope=job(acme, "own"), queue=QUEUE, state=state(acme, day), day=day, own=own,
                           reserve_ms=700, run=run, worker="w") == own
    # A new slot (a duplicate delivery, an operator's release), its run inserted with it.
    new_run = task_run_new(job="tests.noop", queue=QUEUE, account_id=acme.pk, ref="new")
    new = ledger.activate(envelope=job(acme, "new"), queue=QUEUE, state=state(acme, day), day=day, own=None,
                          reserve_ms=300, run=new_run, worker="w")
    assert new_run.pk is not None and Reservation.objects.get(pk=new).task_run_id == new_run.pk
    assert set(Reservation.objects.values_list("ref", "status", "cpu_reserved_ms")) == {
        ("own", S.ACTIVE, 700), ("new", S.ACTIVE, 300)}
    assert usage(acme, day).cpu_reserved_ms == 1000


def test_admit_at_once_admits_a_sent_job_below_its_caps_and_leaves_the_rest_to_the_lock(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    ledger.dispatch(envelope=job(acme, "a"), queue=QUEUE, day=day)
    run = task_run_new(job="tests.noop", queue=QUEUE, account_id=acme.pk, ref="a")
    admitted = ledger.admit_at_once(envelope=job(acme, "a"), queue=QUEUE, day=day, reserve_ms=1000, run=run, worker="w")
    assert admitted.slot_id == Reservation.objects.get(ref="a", status=S.ACTIVE).pk and not admitted.paused
    assert TaskRun.objects.get(pk=run.pk).ref == "a" and usage(acme, day).cpu_reserved_ms == 1000
    # No slot of its own: nothing done here.
    other = task_run_new(job="tests.noop", queue=QUEUE, account_id=acme.pk, ref="b")
    assert ledger.admit_at_once(envelope=job(acme, "b"), queue=QUEUE, day=day, reserve_ms=1000, run=other,
                                worker="w").slot_id is None


def test_claim_for_takes_the_first_job_of_the_line_with_its_slot_and_admits_it(acme, day):
    for ref in ("first", "second"):
        holding.hold(envelope=job(acme, ref), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                     eligible_at=holding.clock.now())
    with transaction.atomic():
        usage_id = ledger.usage_id(state(acme, day), account_id=acme.pk, queue=QUEUE, day=day)
        first = ledger.claim_for(account_id=acme.pk, queue=QUEUE, day=day, worker="w1", usage=usage_id,
                                 reserve_ms=300, yield_to_broker=False)
        admitted = ledger.claim_for(account_id=acme.pk, queue=QUEUE, day=day, worker="w2", usage=usage_id,
                                    reserve_ms=500, yield_to_broker=False)
    assert (first.envelope.ref, admitted.envelope.ref, admitted.reserved_ms) == ("first", "second", 500)
    assert Reservation.objects.get(pk=admitted.slot_id).status == S.ACTIVE and admitted.run.pk is not None
    assert TaskRun.objects.get(pk=admitted.run.pk).outcome == Outcome.RUNNING  # recorded from its claim
    assert usage(acme, day).cpu_reserved_ms == 800
    assert dict(DeferredTask.objects.values_list("ref", "claimed_by")) == {"first": "w1", "second": "w2"}

    # It starts: its claim completes. A second start finds it gone and must not run.
    assert ledger.start_admitted(slot_id=admitted.slot_id, envelope=admitted.envelope, worker="w2") is True
    assert not DeferredTask.objects.filter(ref="second").exists()
    assert ledger.start_admitted(slot_id=admitted.slot_id, envelope=admitted.envelope, worker="w2") is False

    # More for it when the account has it; none beyond its budget.
    assert ledger.reserve_more(slot_id=admitted.slot_id, usage_id=admitted.usage_id, ms=1000, checked=False) is True
    assert ledger.reserve_more(slot_id=admitted.slot_id, usage_id=admitted.usage_id, ms=9000, checked=False) is False
    ledger.reserve_more(slot_id=admitted.slot_id, usage_id=admitted.usage_id, ms=100, checked=True)
    assert Reservation.objects.get(pk=admitted.slot_id).cpu_reserved_ms == 1600
    assert usage(acme, day).cpu_reserved_ms == 1900  # with the first's 300


def test_unadmit_gives_back_what_an_admission_that_never_started_reserved(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = active(acme, day, "a", reserve_ms=800)
    past = timezone.now() - dt.timedelta(seconds=1)
    assert ledger.unadmit(slot_id=slot, account_id=acme.pk, queue=QUEUE, expired_before=past) is None  # lease live
    run_id = ledger.unadmit(slot_id=slot, account_id=acme.pk, queue=QUEUE)
    assert run_id == TaskRun.objects.get(ref="a").pk and not Reservation.objects.exists()
    assert (usage(acme, day).cpu_reserved_ms, usage(acme, day).cpu_used_ms, usage(acme, day).runs) == (0, 0, 0)


def test_renew_grow_reclaim_and_revive(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = active(acme, day, "a", reserve_ms=1000)
    assert ledger.renew(slot_id=slot, cpu_ms=400) is True
    assert Reservation.objects.get(pk=slot).cpu_reported_ms == 400
    assert ledger.grow(slot_id=slot, usage_id=usage(acme, day).pk, cpu_ms=900, ms=500) is True
    assert Reservation.objects.get(pk=slot).cpu_reserved_ms == 1500 and usage(acme, day).cpu_reserved_ms == 1500

    # Its lease expired: charged what it reported, its reservation given back.
    with transaction.atomic():
        ledger.reclaim(slot=Reservation.objects.select_for_update().get(pk=slot), charge_ms=900)
    row = Reservation.objects.get(pk=slot)
    assert (row.status, row.cpu_charged_ms) == (S.RECLAIMED, 900)
    assert (usage(acme, day).cpu_used_ms, usage(acme, day).cpu_reserved_ms, usage(acme, day).runs) == (900, 0, 1)
    assert ledger.renew(slot_id=slot, cpu_ms=950) is False  # no longer the run's

    # Its worker was only frozen: the slot is its again, the run counted once.
    with transaction.atomic():
        assert ledger.revive(slot_id=slot, account_id=acme.pk, queue=QUEUE, reserve_ms=1000) == 900
    assert Reservation.objects.get(pk=slot).status == S.ACTIVE
    assert (usage(acme, day).cpu_reserved_ms, usage(acme, day).runs) == (1000, 0)


def test_charge_settles_exactly_once_and_reads_what_waits_with_it(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = active(acme, day, "a", reserve_ms=1000)
    holding.hold(envelope=job(acme, "next"), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                 eligible_at=holding.clock.now())
    meter = Meter(cpu_ms=120, wall_ms=300, db_wait_ms=5.4, storage_wait_ms=2.6)
    end = RunEnd(meter=meter, outcome=Outcome.SUCCEEDED)
    charged = ledger.charge(slot_id=slot, account_id=acme.pk, queue=QUEUE, meter=meter, cap_hit=False, end=end,
                            now=holding.clock.now())
    assert charged.task_run_id == TaskRun.objects.get(ref="a").pk
    assert (charged.was_active, charged.in_line, charged.waiting, charged.passed) == (True, True, True, None)
    u = usage(acme, day)
    assert (u.cpu_used_ms, u.cpu_reserved_ms, u.runs, u.wall_ms, u.db_wait_ms, u.storage_wait_ms) == (120, 0, 1, 300, 5, 3)
    assert TaskRun.objects.get(ref="a").cpu_ms == 120
    assert ledger.charge(slot_id=slot, account_id=acme.pk, queue=QUEUE, meter=meter, cap_hit=False, end=end,
                         now=holding.clock.now()) is None  # settled already: nothing charged twice


def test_charge_passes_the_slot_on_to_the_next_job_of_the_line(acme, day, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "RESERVATION_STEP_MS": 1000, "CHARGE_CARRY_S": 0}
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = active(acme, day, "a", reserve_ms=1000)
    holding.hold(envelope=job(acme, "next"), queue=QUEUE, reason=DeferReason.CONCURRENCY_CAP,
                 eligible_at=holding.clock.now())
    meter = Meter(cpu_ms=100, wall_ms=150)
    charged = ledger.charge(slot_id=slot, account_id=acme.pk, queue=QUEUE, meter=meter, cap_hit=False,
                            end=RunEnd(meter=meter, outcome=Outcome.SUCCEEDED), now=holding.clock.now(),
                            pass_on=PassOn(worker="w", day=day, lease_s=30))
    passed = charged.passed
    assert (passed.envelope.ref, passed.reserved_ms, passed.usage_id) == ("next", 900, usage(acme, day).pk)
    assert Reservation.objects.get(pk=passed.slot_id).status == S.ACTIVE
    assert DeferredTask.objects.get(ref="next").claimed_by == "w"
    u = usage(acme, day)
    assert (u.cpu_used_ms, u.cpu_reserved_ms, u.runs) == (100, 900, 1)  # what the run left, kept for the next
