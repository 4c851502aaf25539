"""The admission without the lock (budgets.ledger admit_at_once): one statement for a
job sent with a slot of its own, exact against admissions made under the lock at the same time."""
import threading

import pytest
from django.db import connections

from budgets import clock
from budgets import ledger
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.admission import admit
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask, TaskRun
from scheduling.services import task_run_new
from tests.conftest import backend_waiting_for, connect_outside_django, wait_for

pytestmark = [pytest.mark.django_db(transaction=True)]


def _sent(account, ref: str) -> Envelope:
    """A job sent to the broker with a slot of its own (as the enqueue-time check leaves it)."""
    sent = Envelope(job="tests.noop", account=account.pk, ref=ref)
    ledger.dispatch(envelope=sent, queue="default", day=clock.budget_day())
    return sent


def _admit(sent: Envelope):
    run = task_run_new(job=sent.job, queue="default", account_id=sent.account, ref=sent.ref)
    return admit(envelope=sent, queue="default", estimate_ms=10, worker="w", run=run)


@pytest.fixture
def capped(account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day())  # not the day's first run
    return account


def test_a_sent_job_is_admitted_in_one_statement(capped, django_assert_num_queries):
    sent = _sent(capped, "0/a")

    with django_assert_num_queries(1):
        admission = _admit(sent)

    slot = Reservation.objects.get()
    assert (admission.slot_id, slot.status, slot.cpu_reserved_ms) == (slot.pk, ReservationStatus.ACTIVE, 1000)
    assert TaskRun.objects.get(pk=slot.task_run_id).ref == "0/a"
    assert UsageDay.objects.get().cpu_reserved_ms == 1000


def test_it_leaves_to_the_lock_a_job_its_account_has_no_room_for(capped):
    running, second = _sent(capped, "0/a"), _sent(capped, "0/b")  # sent one too many (racing enqueues)
    assert _admit(running).admitted

    held = _admit(second)

    assert held.reason == DeferReason.CONCURRENCY_CAP  # decided under the lock, as before
    assert list(Reservation.objects.values_list("ref", "status")) == [("0/a", ReservationStatus.ACTIVE)]
    assert DeferredTask.objects.get().ref == "0/b"


def test_it_yields_to_an_admission_under_the_lock_that_committed_after_its_snapshot(capped):
    """The admission under the lock in another session makes "0/a" active and commits while this
    admission's statement waits for the Budget row: its snapshot (taken before) does not show that
    run, so it must not decide on it. It admits nothing itself and the lock decides: held."""
    first, second = _sent(capped, "0/a"), _sent(capped, "0/b")
    other = connect_outside_django()
    result = {}
    try:
        other.execute("UPDATE budgets_budget SET max_concurrent = max_concurrent WHERE account_id = %s",
                      [capped.pk])  # the lock, as budgets.standing.lock takes it
        other.execute("UPDATE budgets_reservation SET status = 'active' WHERE ref = %s", [first.ref])

        def admit_second():
            try:
                result["admission"] = _admit(second)
            except BaseException as exc:  # reported by the assertions below
                result["error"] = exc
            finally:
                connections.close_all()

        thread = threading.Thread(target=admit_second)
        thread.start()
        wait_for(lambda: backend_waiting_for(other, "%WITH b AS%"), timeout=10,
                 message="the admission to wait for the Budget row")
        other.commit()
        thread.join(10)
    finally:
        other.close()

    assert "error" not in result, result
    assert result["admission"].reason == DeferReason.CONCURRENCY_CAP
    assert list(Reservation.objects.values_list("ref", "status")) == [("0/a", ReservationStatus.ACTIVE)]
    assert not TaskRun.objects.filter(ref="0/b").exclude(outcome="deferred").exists()
