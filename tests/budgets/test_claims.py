"""Hand-off and pull in-process: which held job a freed slot goes to, and what a claim guarantees
(budgets.handoff, scheduling.holding claims). The same with real workers: test_handoff.py."""
import datetime as dt

import pytest
from django.utils import timezone
from django_q.models import OrmQ

from budgets.handoff import fetch_next
from budgets.models import Budget, Reservation, ReservationStatus
from budgets.admission import admit, start_admitted
from budgets.handoff import release_due
from budgets.reclaim import reclaim_expired
from budgets.settlement import settle
from scheduling import clock
from scheduling.envelope import Envelope
from scheduling.holding import hold
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause, TaskRun
from scheduling.runtime import enqueue_many
from tests.budgets.test_admission import meter, usage
from tests.factories import AccountFactory

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def budget(account, cap: int) -> Budget:
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=cap)


def start(handed, *, worker: str):
    return start_admitted(claimed=handed, queue="default", worker=worker)


def run(account, ref: str):
    return admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", estimate_ms=10,
                 worker="w")


def test_settlement_hands_the_freed_slot_to_the_accounts_oldest_held_job(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(3)])
    first = run(account, "0/0")

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                     hand_to="w1")

    handed = settled.handed_to
    assert handed.envelope == Envelope(job="tests.noop", account=account.pk, ref="0/1")
    assert OrmQ.objects.count() == 1  # the first job's message only: nothing went to the broker
    claimed = DeferredTask.objects.get(ref="0/1")
    assert claimed.claimed_by == "w1"
    # Admitted in the settlement's transaction: its slot is running, its run recorded as started.
    slot = Reservation.objects.get()
    assert (slot.ref, slot.status, slot.task_run_id) == ("0/1", ReservationStatus.ACTIVE, handed.run.pk)
    assert TaskRun.objects.get(pk=handed.run.pk).outcome == Outcome.RUNNING
    assert usage(account).cpu_reserved_ms == handed.reserved_ms
    # When it starts it takes the job out of the holding area; the next waits.
    assert start(handed, worker="w1").admitted
    assert list(DeferredTask.objects.values_list("ref", "claimed_by")) == [("0/2", "")]


def test_a_job_admitted_with_its_claim_whose_worker_died_before_starting_it_is_undone_and_released(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    handed = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                    hand_to="w1").handed_to
    # w1 dies before starting it: its claim and its slot expire together ...
    DeferredTask.objects.update(claim_expires_at=clock.now() - dt.timedelta(seconds=1))
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert reclaim_expired() == 1

    # ... the admission is undone (nothing charged, no run counted), the run is recorded as never
    # started, and the job is released to the broker into the freed slot.
    assert TaskRun.objects.get(pk=handed.run.pk).outcome == Outcome.SKIPPED
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (1, 5, 0)
    assert not DeferredTask.objects.exists()
    slot = Reservation.objects.get()
    assert (slot.ref, slot.status) == ("0/1", ReservationStatus.DISPATCHED)
    assert not start(handed, worker="w1").admitted  # a late start of the dead claimant runs nothing


def test_a_job_admitted_with_its_claim_but_held_again_before_it_starts_does_not_run(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    handed = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                    hand_to="w1").handed_to
    hold(envelope=handed.envelope, queue="default", reason=DeferReason.PAUSED, eligible_at=clock.now())  # voids the claim

    assert not start(handed, worker="w1").admitted
    assert not Reservation.objects.exists() and usage(account).cpu_reserved_ms == 0
    assert DeferredTask.objects.get().reason == DeferReason.PAUSED


def test_a_claimant_that_lost_its_claim_does_not_run_the_job(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    handed = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                    hand_to="w1").handed_to
    # w1 stalls past its claim's lease: the claim and the slot taken for it expire ...
    DeferredTask.objects.update(claim_expires_at=clock.now() - dt.timedelta(seconds=1))
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert reclaim_expired() == 1  # ... and the job is released to the broker, on a new slot.
    assert release_due() == 0
    assert not DeferredTask.objects.exists()
    assert Reservation.objects.get().status == ReservationStatus.DISPATCHED

    late = start(handed, worker="w1")

    assert not late.admitted and late.reason is None  # skipped, not held: nothing runs it twice
    assert not DeferredTask.objects.exists()
    assert run(account, "0/1").admitted  # the copy that was sent runs it, once


def test_an_expired_claim_is_taken_over_only_once_the_reclaim_gave_its_slot_back(account):
    """Its claimant may have started the run (a start writes nothing to the slot): until the
    reclaim decides, with the account's lock, neither a pull nor a release takes the job over, so
    no run is taken for lost that never started and nothing runs twice."""
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    handed = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                    hand_to="w1").handed_to
    # w1 dies before starting it: its claim and its slot expire together; a slot is free beside it.
    Budget.objects.update(max_concurrent=2)
    DeferredTask.objects.update(claim_expires_at=clock.now() - dt.timedelta(seconds=1))
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert fetch_next(queue="default", worker="w2") is None
    assert release_due() == 0
    assert DeferredTask.objects.get().claimed_by == "w1"

    assert reclaim_expired() == 1  # undone, and the job released into the freed slot
    assert TaskRun.objects.get(pk=handed.run.pk).outcome == Outcome.SKIPPED
    assert not TaskRun.objects.filter(outcome=Outcome.LOST).exists()
    slot = Reservation.objects.get()
    assert (slot.ref, slot.status) == ("0/1", ReservationStatus.DISPATCHED)


def test_an_expired_claim_is_released_like_any_held_job(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
           hand_to="w1")
    assert release_due() == 0  # claimed, and its slot taken: nothing to release
    Reservation.objects.all().delete()  # (as if the slot's lease had expired and been reclaimed)
    assert release_due() == 0  # the claim itself is still live

    DeferredTask.objects.update(claim_expires_at=clock.now() - dt.timedelta(seconds=1))

    assert release_due() == 1
    assert not DeferredTask.objects.exists()


def test_pull_serves_the_account_with_the_fewest_slots_in_use_first_and_only_into_free_slots():
    full, busy, idle = AccountFactory(slug="full"), AccountFactory(slug="busy"), AccountFactory(slug="idle")
    budget(full, cap=1)
    budget(busy, cap=3)
    budget(idle, cap=3)
    # Held in this order (full's waited longest): full at its cap with one held; busy with 3 sent
    # and 2 held, then one of its slots freed; idle with nothing sent and one held.
    enqueue_many(job="tests.noop", work=[(full.pk, "0/f-0"), (full.pk, "0/f-1")])
    enqueue_many(job="tests.noop", work=[(busy.pk, f"0/b-{i}") for i in range(5)])
    Reservation.objects.filter(ref="0/b-0").delete()
    Reservation.objects.update(status=ReservationStatus.ACTIVE)  # the rest are running
    hold(envelope=Envelope(job="tests.noop", account=idle.pk, ref="0/i-0"), queue="default",
         reason=DeferReason.RETRY_BACKOFF, eligible_at=clock.now())

    pulled = [getattr(fetch_next(queue="default", worker="w2"), "envelope", None) for _ in range(3)]

    assert pulled == [Envelope(job="tests.noop", account=idle.pk, ref="0/i-0"),  # no slot in use
                      Envelope(job="tests.noop", account=busy.pk, ref="0/b-3"),  # its oldest held
                      None]  # busy is at its cap now, and full was all along
    assert DeferredTask.objects.get(ref="0/f-1").claimed_by == ""
    assert Reservation.objects.filter(account=busy).count() == 3


def test_a_worker_yields_to_work_waiting_in_the_broker_instead_of_claiming(account, other_account):
    budget(account, cap=1)
    budget(other_account, cap=2)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    # Another account's job was sent a while ago and no worker has started it: all are busy.
    enqueue_many(job="tests.noop", work=[(other_account.pk, "0/waiting")])
    Reservation.objects.filter(ref="0/waiting").update(created_at=timezone.now() - dt.timedelta(seconds=5))

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                     hand_to="w1")

    assert settled.handed_to is None  # the worker goes back to the broker ...
    assert fetch_next(queue="default", worker="w1") is None
    # ... and the freed slot's job waits in line, not behind the broker's job (which would run it
    # first in, first out): every worker is busy, and the first to take the broker's job pulls it next.
    assert not Reservation.objects.filter(account=account).exists()
    assert DeferredTask.objects.filter(ref="0/1", claimed_by="").exists()
    assert run(other_account, "0/waiting").admitted
    assert fetch_next(queue="default", worker="w1").envelope.ref == "0/1"


def test_a_settlement_passes_its_slot_on_with_what_is_left_of_its_reservation(account, settings):
    """The lock-free pass-on (the ledger's settlement) of a run that came from the holding area:
    the next job keeps what the run did not use of its reservation, at most a step, so the
    account's used + reserved CPU never grows; below half a step the slot is handed off under the
    lock instead, with a fresh step. The run's figures go on with the slot (carried) and are
    charged to the day when the chain of pass-ons ends: until then its CPU stays reserved."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "RESERVATION_STEP_MS": 1000}
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(4)])
    first = run(account, "0/0")
    # Sent through the broker: its settlement hands off under the lock, with a fresh step.
    second = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(300),
                    hand_to="w1").handed_to
    assert second.reserved_ms == 1000
    assert start(second, worker="w1").admitted

    third = settle(slot_id=second.slot_id, account_id=account.pk, queue="default",
                   meter=meter(300, wall_ms=350, db_ms=10.4, storage_ms=2.6), hand_to="w1", from_line=True).handed_to

    assert third.envelope.ref == "0/2" and third.reserved_ms == 700
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (1, 300, 1000)  # 700 for the third, 300 carried
    slot = Reservation.objects.get()
    assert (slot.ref, slot.status, slot.cpu_reserved_ms, slot.worker) == ("0/2", ReservationStatus.ACTIVE, 700, "w1")
    assert (slot.carried_runs, slot.carried_cpu_ms, slot.carried_wall_ms, slot.carried_db_wait_ms,
            slot.carried_storage_wait_ms) == (1, 300, 350, 10, 3)
    assert TaskRun.objects.get(pk=third.run.pk).outcome == Outcome.RUNNING
    assert DeferredTask.objects.get(ref="0/2").claimed_by == "w1"
    assert start(third, worker="w1").admitted

    fourth = settle(slot_id=third.slot_id, account_id=account.pk, queue="default",
                    meter=meter(300), hand_to="w1", from_line=True).handed_to

    assert fourth.envelope.ref == "0/3" and fourth.reserved_ms == 1000  # 400 left: a fresh step
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (3, 900, 1000)  # the carried run charged with it
    assert (day.wall_ms, day.db_wait_ms, day.storage_wait_ms) == (350, 10, 3)
    assert start(fourth, worker="w1").admitted
    settle(slot_id=fourth.slot_id, account_id=account.pk, queue="default", meter=meter(1),
           hand_to="w1", from_line=True)
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (4, 901, 0)
    assert not Reservation.objects.exists() and not DeferredTask.objects.exists()


def test_a_slot_is_not_passed_on_past_a_cap_lowered_meanwhile(account):
    capped = budget(account, cap=2)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(3)])
    first, _ = run(account, "0/0"), run(account, "0/1")
    capped.max_concurrent = 1  # an operator lowers the cap while both run
    capped.save()

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                     hand_to="w1", from_line=True)

    assert settled.handed_to is None  # the slot is freed, not passed on: one still runs, the cap is 1
    assert list(Reservation.objects.values_list("ref", "status")) == [("0/1", ReservationStatus.ACTIVE)]
    assert DeferredTask.objects.get().claimed_by == ""


def test_a_paused_accounts_line_keeps_its_place_and_its_slot_is_not_passed_on(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(2)])
    first = run(account, "0/0")
    pause = Pause.objects.create(account=account)  # an operator pauses the account while it runs

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                     hand_to="w1", from_line=True)

    # Neither passed on nor handed off nor released: its line waits, in order, for the resume.
    assert settled.handed_to is None
    assert not Reservation.objects.exists() and usage(account).cpu_reserved_ms == 0
    held = DeferredTask.objects.get()
    assert (held.ref, held.claimed_by, held.in_line_since is not None) == ("0/1", "", True)
    assert release_due() == 0 and fetch_next(queue="default", worker="w1") is None
    pause.delete()  # (resume: scheduling.pausing.resume)
    assert fetch_next(queue="default", worker="w1").envelope.ref == "0/1"
