"""Carried charges (the settlement's pass-on): a slot passed from run to run of one account
carries its runs' figures instead of charging the day's usage row with each, and whatever ends
the slot charges them: the chain's last settlement, the reclaim of a dead run, an admission undone.
Meanwhile their CPU stays reserved, so used + reserved is what charging at once would give, and
the cap holds exactly. The same with real workers, killed: test_handoff.py."""
import datetime as dt

import pytest
from django.utils import timezone

from budgets.admission import admit
from budgets.models import Reservation, ReservationStatus
from budgets.reclaim import reclaim_expired
from budgets.settlement import settle
from scheduling import clock
from scheduling.holding import hold
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.envelope import Envelope
from scheduling.runtime import enqueue_many
from scheduling.services import task_run_new
from tests.budgets.test_admission import meter, usage
from tests.budgets.test_claims import budget, start
from tests.budgets.test_processes import ledger_totals, recorded_totals

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

RUN = {"cpu_ms": 40, "wall_ms": 55, "db_wait_ms": 4, "storage_wait_ms": 2}  # what each run here measures


def a_chain(account, settings, *, jobs: int):
    """`jobs` held jobs of a cap-1 account: the first runs through the broker and hands its slot to
    the second under the lock (a fresh step); returns the second, started. Each later settlement
    with `from_line` passes the slot on."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "RESERVATION_STEP_MS": 1000, "CHARGE_CARRY_S": 60.0}
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(jobs)])
    first = run(account, "0/0")
    second = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=a_run(),
                    hand_to="w1").handed_to
    assert start(second, worker="w1").admitted
    return second


def run(account, ref: str):
    """A job sent through the broker starts on its own slot, its run recorded."""
    return admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", estimate_ms=10,
                 worker="w", run=task_run_new(job="tests.noop", queue="default", account_id=account.pk, ref=ref))


def a_run():
    return meter(RUN["cpu_ms"], wall_ms=RUN["wall_ms"], db_ms=RUN["db_wait_ms"], storage_ms=RUN["storage_wait_ms"])


def pass_on(handed):
    return settle(slot_id=handed.slot_id, account_id=handed.envelope.account, queue="default", meter=a_run(),
                  hand_to="w1", from_line=True).handed_to


def pass_on_started(handed):
    handed = pass_on(handed)
    assert start(handed, worker="w1").admitted
    return handed


def charged(account) -> dict:
    return ledger_totals(account, usage(account).day)


def ran(account):
    """What the settled runs recorded (settled in-process, without an outcome)."""
    return recorded_totals(TaskRun.objects.filter(account=account, finished_at__isnull=False)
                           .exclude(outcome__in=(Outcome.SKIPPED, Outcome.LOST)))


def test_a_chain_of_pass_ons_charges_nothing_until_it_ends_and_then_exactly(account, settings):
    handed = a_chain(account, settings, jobs=6)
    before = usage(account)
    for n in range(1, 5):
        handed = pass_on(handed)
        assert start(handed, worker="w1").admitted
        day = usage(account)
        # The usage row is not written: the runs so far ride on the slot, their CPU still reserved.
        assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (
            before.runs, before.cpu_used_ms, before.cpu_reserved_ms)
        slot = Reservation.objects.get()
        assert (slot.carried_runs, slot.carried_cpu_ms, slot.carried_wall_ms) == (n, 40 * n, 55 * n)
        assert slot.cpu_reserved_ms + slot.carried_cpu_ms == 1000  # the step, less nothing given back

    # The last job: nothing left in line, so its settlement ends the chain and charges it all.
    assert pass_on(handed) is None
    assert not Reservation.objects.exists()
    assert charged(account) == ran(account) and ran(account)["runs"] == 6
    assert usage(account).cpu_reserved_ms == 0


def test_a_pass_on_charges_what_its_slot_carried_for_longer_than_charge_carry_s(account, settings):
    handed = pass_on(a_chain(account, settings, jobs=4))
    assert start(handed, worker="w1").admitted
    assert Reservation.objects.get().carried_runs == 1
    Reservation.objects.update(carried_since=timezone.now() - dt.timedelta(seconds=61))

    handed = pass_on(handed)

    assert Reservation.objects.get().carried_runs == 0  # charged, and the new slot starts afresh
    assert charged(account) == ran(account) and ran(account)["runs"] == 3


def test_with_charge_carry_s_zero_every_settlement_charges(account, settings):
    handed = a_chain(account, settings, jobs=4)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "CHARGE_CARRY_S": 0.0}
    for _ in range(2):
        handed = pass_on(handed)
        assert start(handed, worker="w1").admitted
        assert Reservation.objects.get().carried_runs == 0
        assert charged(account) == ran(account)


def test_a_dead_run_whose_slot_carried_charges_is_charged_them_by_the_reclaim(account, settings):
    handed = pass_on(pass_on_started(a_chain(account, settings, jobs=5)))
    assert start(handed, worker="w1").admitted
    Reservation.objects.filter(pk=handed.slot_id).update(cpu_reported_ms=30)
    # Its worker dies mid-run: the watcher stops renewing its lease.
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert reclaim_expired() == 1

    slot = Reservation.objects.get(pk=handed.slot_id)
    assert (slot.status, slot.carried_runs, slot.carried_cpu_ms) == (ReservationStatus.RECLAIMED, 0, 0)
    lost = TaskRun.objects.get(pk=handed.run.pk)
    assert (lost.outcome, lost.cpu_ms) == (Outcome.LOST, 30)
    day = charged(account)
    assert day == {**ran(account), "cpu_ms": ran(account)["cpu_ms"] + 30, "runs": ran(account)["runs"] + 1}
    assert usage(account).cpu_reserved_ms == 0  # the next job went to the broker: its slot reserves nothing yet
    assert not Reservation.objects.exclude(pk=handed.slot_id).filter(status=ReservationStatus.ACTIVE).exists()


def test_an_admission_undone_charges_what_its_slot_carried(account, settings):
    """A passed-on job whose worker died before starting it (the reclaim undoes its admission), and
    one held again before it started (its start undoes it): the runs its slot carried are charged."""
    handed = pass_on(pass_on_started(a_chain(account, settings, jobs=6)))
    DeferredTask.objects.update(claim_expires_at=clock.now() - dt.timedelta(seconds=1))
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert reclaim_expired() == 1

    assert TaskRun.objects.get(pk=handed.run.pk).outcome == Outcome.SKIPPED
    assert charged(account) == ran(account) and ran(account)["runs"] == 3

    # The job it released runs through the broker and hands off under the lock; the next one
    # passes its slot on to the last, which is held again before it starts.
    released = run(account, handed.envelope.ref)
    fifth = settle(slot_id=released.slot_id, account_id=account.pk, queue="default", meter=a_run(),
                   hand_to="w1").handed_to
    assert start(fifth, worker="w1").admitted
    handed = pass_on(fifth)
    assert Reservation.objects.get().carried_runs == 1
    # Held again (a duplicate delivery, say) before it starts: that voids its claim.
    hold(envelope=handed.envelope, queue="default", reason=DeferReason.PAUSED, eligible_at=clock.now())

    assert not start(handed, worker="w1").admitted

    assert not Reservation.objects.exists()
    assert charged(account) == ran(account) and ran(account)["runs"] == 5
    assert usage(account).cpu_reserved_ms == 0
