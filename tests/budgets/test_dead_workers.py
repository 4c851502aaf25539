"""What a worker that died held, given back at once (budgets.reclaim `reclaim_worker`, called by its
pool's sentinel once none of its database sessions is left: scheduling.deaths), in-process. The
same with a real pool whose workers are SIGKILLed: tests/scheduling/test_pool.py."""
import pytest

from budgets import ledger
from budgets.admission import admit
from budgets.models import Reservation, ReservationStatus
from budgets.reclaim import reclaim_expired, reclaim_worker
from budgets.settlement import settle
from scheduling.models import DeferredTask, Outcome, TaskRun
from scheduling.envelope import Envelope
from scheduling.runtime import enqueue_many
from scheduling.services import task_run_new
from tests.budgets.test_admission import meter, usage
from tests.budgets.test_claims import budget, run

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def in_flight_of(worker: str) -> list:
    return list(Reservation.objects.filter(worker=worker, status__in=ledger.IN_FLIGHT))


def test_a_dead_workers_running_slot_is_reclaimed_at_once_and_its_accounts_line_goes_on(account, other_account):
    budget(account, cap=1)
    budget(other_account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, "0/0"), (account.pk, "0/1"), (other_account.pk, "0/x")])
    running = admit(envelope=Envelope(job="tests.noop", account=account.pk, ref="0/0"), queue="default",
                    estimate_ms=10, worker="w",
                    run=task_run_new(job="tests.noop", queue="default", account_id=account.pk, ref="0/0"))
    assert ledger.renew(slot_id=running.slot_id, cpu_ms=7)
    Reservation.objects.filter(ref="0/x").update(worker="w2")  # another worker's slot: not touched

    assert reclaim_worker(worker="w") == 1

    # Its run is lost, charged what it reported; its slot went to the next job of the line,
    # whatever the lease said (60 s to go).
    lost = TaskRun.objects.get(ref="0/0")
    assert (lost.outcome, lost.cpu_ms, lost.error_message) == (Outcome.LOST, 7, "its worker died")
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (1, 7, 0)
    assert Reservation.objects.get(ref="0/0").status == ReservationStatus.RECLAIMED
    assert Reservation.objects.get(ref="0/1").status == ReservationStatus.DISPATCHED
    assert not DeferredTask.objects.filter(account=account).exists()
    assert Reservation.objects.get(ref="0/x").worker == "w2"
    # Idempotent: nothing of it is left to give back, by it or by the reclaim.
    assert reclaim_worker(worker="w") == 0
    assert reclaim_expired() == 0
    assert usage(account).runs == 1


def test_a_job_passed_on_to_a_worker_that_died_before_starting_it_goes_on_at_once(account):
    budget(account, cap=1)
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(3)])
    first = run(account, "0/0")
    handed = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5),
                    hand_to="w1").handed_to
    assert DeferredTask.objects.get(ref="0/1").claimed_by == "w1"  # its claim lease: 30 s

    assert reclaim_worker(worker="w1") == 1

    # The admission ahead is undone (nothing charged), and the job, its claim given back, is the
    # first of its line again: it goes to the broker into the freed slot; the next one waits.
    assert TaskRun.objects.get(pk=handed.run.pk).outcome == Outcome.SKIPPED
    day = usage(account)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (1, 5, 0)
    slot = Reservation.objects.get()
    assert (slot.ref, slot.status, slot.worker) == ("0/1", ReservationStatus.DISPATCHED, "")
    assert list(DeferredTask.objects.values_list("ref", "claimed_by")) == [("0/2", "")]
    assert reclaim_worker(worker="w1") == 0
    assert not in_flight_of("w1")
