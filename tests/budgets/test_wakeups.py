"""No lost wake-ups without a lock on settlement: a settlement's charge takes no Budget row lock,
so a job put on hold while a slot is being freed is found by one of the two looks made after a
commit (the settlement's, the hold's). Each test takes one of them away to show what it catches."""
import dataclasses
import threading

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from budgets import clock
from budgets import ledger
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.admission import admit, admit_at_enqueue
from budgets.settlement import settle
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import DeferredTask

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("beating_workers")]


def stopped_meter(cpu_ms: int = 3) -> Meter:
    m = Meter(cpu_ms=cpu_ms, wall_ms=cpu_ms)
    m._stopped = True
    return m


@pytest.fixture
def running(account):
    """The account (cap 1) runs one job: its only slot is taken."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)
    first = Envelope(job="tests.noop", account=account.pk, ref="wake/running")
    assert admit_at_enqueue(envelope=first, queue="default")
    admission = admit(envelope=first, queue="default", estimate_ms=10, worker="host:1")
    assert admission.admitted
    return admission


def settle_in_another_session(account, reservation_id: int) -> None:
    """Settle from a session of its own, while the caller's transaction is still open; fails if
    the settlement waits for that transaction (it would, under the Budget row lock)."""
    errors = []

    def run():
        try:
            settle(slot_id=reservation_id, account_id=account.pk, queue="default", meter=stopped_meter())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), "the settlement waited for the transaction that holds the job"
    assert not errors, errors


@pytest.fixture
def held_while_charging(account, monkeypatch):
    """A job held for the account (its slot is taken), and a charge made to have missed the hold
    (its snapshot taken before the hold committed, the hold's own look before the charge
    committed)."""
    assert not admit_at_enqueue(envelope=Envelope(job="tests.noop", account=account.pk, ref="wake/held"),
                                queue="default")
    backend = ledger
    real_charge = backend.charge

    def charge_that_missed_the_hold(**kwargs):
        charged = real_charge(**kwargs)
        return charged and dataclasses.replace(charged, in_line=False)

    monkeypatch.setattr(backend, "charge", charge_that_missed_the_hold)


def released() -> bool:
    """Whether the held job was released into the freed slot (sent, its hold gone)."""
    sent = Reservation.objects.filter(ref="wake/held", status=ReservationStatus.DISPATCHED).exists()
    assert sent is not DeferredTask.objects.filter(ref="wake/held").exists()
    return sent


@pytest.mark.parametrize("look_after_the_hold", [True, False])
def test_a_job_held_while_the_slot_is_freed_is_released_by_the_look_after_its_hold(
    account, running, monkeypatch, look_after_the_hold,
):
    """The enqueue saw the slot taken; before its hold is written, the running job settles (its
    charge and its look after it see nothing held, and it commits first). Only the hold's own look
    after its commit can find the freed slot."""
    from budgets import admission

    real_hold = admission.hold

    def settle_first(**kwargs):
        settle_in_another_session(account, running.slot_id)
        real_hold(**kwargs)

    monkeypatch.setattr("budgets.admission.hold", settle_first)
    if not look_after_the_hold:
        monkeypatch.setattr("budgets.admission.wake_when_committed", lambda **kwargs: None)

    assert not admit_at_enqueue(envelope=Envelope(job="tests.noop", account=account.pk, ref="wake/held"),
                                queue="default")

    assert not Reservation.objects.filter(ref="wake/running").exists()
    assert released() is look_after_the_hold  # else the wake-up would be lost until the next pulse
    assert UsageDay.objects.get(account=account, day=clock.budget_day()).runs == 1


@pytest.mark.parametrize("look_after_the_charge", [True, False])
def test_a_settlement_whose_charge_missed_a_hold_finds_it_once_committed(
    account, running, held_while_charging, monkeypatch, look_after_the_charge,
):
    """The hold committed after the charge's statement took its snapshot (and the hold's own look
    ran before the charge committed, seeing the slot still taken): only the settlement's look
    after its commit can find it. Here the charge is made to have missed it."""
    if not look_after_the_charge:
        monkeypatch.setattr("scheduling.holding.in_line", lambda **kwargs: False)

    settled = settle(slot_id=running.slot_id, account_id=account.pk, queue="default",
                     meter=stopped_meter())

    assert settled is not None
    assert released() is look_after_the_charge


@pytest.mark.parametrize("watcher_looks", [True, False])
def test_a_workers_settlement_leaves_its_look_to_the_watcher(
    account, running, held_while_charging, monkeypatch, watcher_looks,
):
    """In a worker the settlement's look after its commit is the watcher thread's, made at its
    next tick for every account and queue settled since (a statement less per run): the same
    missed hold as above is released by it, and only by it."""
    from budgets.watcher import Watcher

    if not watcher_looks:
        monkeypatch.setattr("budgets.watcher.release_if_ready", lambda **kwargs: 0)
    watcher = Watcher()  # not started: its tick's look is made below

    with CaptureQueriesContext(connection) as queries:
        settled = settle(slot_id=running.slot_id, account_id=account.pk, queue="default",
                         meter=stopped_meter(), look_again_later=watcher.look_again_later)

    assert settled is not None
    assert len(queries) == 1  # the charge alone
    assert not released()
    assert watcher.look() is True and watcher.look() is False  # once per settled account and queue
    assert released() is watcher_looks


def test_the_watcher_thread_makes_the_look_at_its_tick(account, running, held_while_charging):
    """The same with the watcher running (a daemon thread, as in a worker): nothing else looks
    here (no pulse in tests), so the held job is released by its tick."""
    import time

    from budgets.watcher import Watcher

    watcher = Watcher()
    watcher.start()

    settle(slot_id=running.slot_id, account_id=account.pk, queue="default",
           meter=stopped_meter(), look_again_later=watcher.look_again_later)

    deadline = time.monotonic() + 20  # a tick is 0.2 s; bounded, not timed
    while DeferredTask.objects.filter(ref="wake/held").exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # polls the hold alone: released() reads two tables, not one snapshot
    assert released()
