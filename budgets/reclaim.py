"""The reclaim (`scheduling.reclaim_leases`, every minute): slots whose lease expired are given back.

- a running slot whose watcher stopped renewing it (its worker died, or froze): the CPU it had
  reported is charged (or what its run recorded, when the run finished but could not settle), its
  run is marked lost, slot and reservation go back (ledger `reclaim`: RECLAIMED). A run that was
  only slow settles later for the rest, and one that wakes from a freeze finds its slot gone
  (budgets.running.reservation_renew) and stops;
- a job admitted ahead with its claim whose worker stopped before starting it: the admission is
  undone (`unadmit`), its run recorded skipped, nothing charged;
- a dispatched slot whose message never started within FAIRSHARE["DISPATCH_LEASE_S"] (a lost
  broker message): given back, and its job waits in the holding area (`message_lost`) to be sent
  again, so a lost message costs latency, never the job.
Each frees a slot: the account's line goes into it.

What it reads: the slots whose lease expired (index reservation_lease), then each one's account.

A worker's death seen by its pool's sentinel (scheduling.deaths) takes the same steps at once for
that worker's slots and claims (`reclaim_worker`), whatever their leases say: the lease is the last
resort, for a worker nobody saw die (a whole machine gone, a frozen one).
"""
import datetime as dt
from collections.abc import Callable

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from budgets import clock
from budgets.admission import hold_and_wake
from budgets.handoff import release
from budgets import ledger
from budgets.ledger import IN_FLIGHT
from budgets.locks import lock
from budgets.models import Reservation, ReservationStatus
from scheduling import holding
from scheduling.envelope import Envelope
from scheduling.models import DeferReason
from scheduling.selectors import finished_run_cpu_ms
from scheduling.services import task_run_mark_lost, task_run_mark_not_started


def reclaim_expired() -> int:
    """Give back the slots whose lease expired (see the module's docstring); returns how many."""
    reclaimed = _reclaim(lambda: Q(lease_expires_at__lt=timezone.now()), died=None)
    # A reclaimed run that really died never settles; forget it after a day.
    Reservation.objects.filter(
        status=ReservationStatus.RECLAIMED, lease_expires_at__lt=timezone.now() - dt.timedelta(days=1)).delete()
    return reclaimed


def reclaim_worker(*, worker: str) -> int:
    """Give back at once what `worker` held, whatever its leases say: it died, and none of its
    database sessions is left, so nothing of it can commit any more (its pool's sentinel waited
    for that: scheduling.deaths). The reclaim's steps (module docstring) for its slots: the run it
    was running is charged what it reported and recorded lost; a job admitted ahead for it with its
    claim is undone and the claim given back, so the job is claimable again in its place in line;
    and each freed slot goes to its account's line. Idempotent: a second call, or the reclaim once
    the leases expire, finds nothing of it. Returns how many slots it gave back.

    What it reads, once per death (never per task): the slots in flight, without an index by worker
    (the table holds the slots in flight and the reclaimed ones of the last day; an index on
    `worker` would be written by every admission and lease renewal).
    """
    return _reclaim(lambda: Q(worker=worker), died=worker)


def _reclaim(whose: Callable[[], Q], *, died: str | None) -> int:
    """Give back each slot in flight that `whose()` selects (asked again under the lock), one
    transaction each, under its account's lock; `died`: the worker that died holding them."""
    reclaimed = 0
    found = Reservation.objects.filter(whose(), status__in=IN_FLIGHT)
    for account_id, queue, pk in found.values_list("account_id", "queue", "pk"):
        with transaction.atomic():
            day = clock.budget_day()
            lock(account_id=account_id, queue=queue)
            # Its row locked: a settlement (which takes no Budget lock) of a run that was only slow
            # then waits for the reclaim and charges what the reclaim did not, or went first.
            slot = Reservation.objects.select_for_update().filter(whose(), pk=pk, status__in=IN_FLIGHT).first()
            if slot is None or not _give_back(slot, died=died):
                continue  # it settled, started or renewed meanwhile
            state = ledger.standing(account_id=account_id, queue=queue, day=day)
            release(account_id=account_id, queue=queue, state=state, limit=1, day=day)
            reclaimed += 1
    return reclaimed


def _give_back(slot: Reservation, *, died: str | None) -> bool:
    """Under the lock, the slot locked: give it back as its state says; False when it started
    meanwhile. `died`: its worker died (reclaim_worker), else its lease expired."""
    if slot.status == ReservationStatus.DISPATCHED:
        ledger.drop(slot_id=slot.pk)  # if the message turns up after all, admission checks it again
        hold_and_wake(envelope=Envelope(job=slot.job, account=slot.account_id, ref=slot.ref), queue=slot.queue,
                      reason=DeferReason.MESSAGE_LOST, eligible_at=clock.now())
        return True
    if holding.claim_held(job=slot.job, ref=slot.ref, worker=slot.worker):
        # Admitted ahead with its claim, and its worker stopped before it started: undone, its
        # run skipped; the job, its claim given back (or expired with the slot), is released by
        # the caller.
        run_id = ledger.unadmit(slot_id=slot.pk, account_id=slot.account_id, queue=slot.queue,
                                  expired_before=None if died else timezone.now())
        if run_id is None:
            return False
        holding.unclaim(job=slot.job, ref=slot.ref, worker=slot.worker)
        task_run_mark_not_started(run_id=run_id, reason="handed off to a worker that stopped before starting it")
        return True
    charge = _reclaim_charge(slot)
    ledger.reclaim(slot=slot, charge_ms=charge)
    if slot.task_run_id:
        why = "its worker died" if died else "the run stopped renewing its lease (its worker died)"
        task_run_mark_lost(run_id=slot.task_run_id, cpu_ms=charge, reason=why)
    return True


def _reclaim_charge(slot: Reservation) -> int:
    """What a reclaimed run is charged: the CPU its TaskRun recorded when the run finished but could
    not settle (its connection was gone), else the CPU it last reported (its worker died)."""
    recorded = finished_run_cpu_ms(run_id=slot.task_run_id) if slot.task_run_id else None
    return max(slot.cpu_reported_ms, recorded or 0)
