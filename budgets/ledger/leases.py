"""The transitions of a running slot's lease: its watcher renews it (and grows its reservation); once
it expired the reclaim takes the slot back (RECLAIMED), and a run that turns out to be alive may
get it back (`revive`). Under the account's lock but `renew` (budgets.running, budgets.reclaim).

Cost: rows by key (the slot, the account's usage row of the slot's day, its run).
"""
from django.db.models import F

from budgets import standing
from budgets.ledger.settling import NOTHING_CARRIED, charge_day
from budgets.models import Reservation, ReservationStatus, UsageDay
from scheduling.services import task_run_mark_running_again


def renew(*, slot_id: int, cpu_ms: int) -> bool:
    """ACTIVE -> ACTIVE: a running slot reports its CPU and renews its lease; False when the slot is
    no longer the run's (it was reclaimed while its worker was frozen, or settled)."""
    return Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry()) == 1


def grow(*, slot_id: int, usage_id: int, cpu_ms: int, ms: int) -> bool:
    """ACTIVE -> ACTIVE: `ms` more CPU reserved for a running slot, which also renews its lease; the
    caller (under the lock) decided the account has it. False when the slot is gone."""
    if not Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
            cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry(),
            cpu_reserved_ms=F("cpu_reserved_ms") + ms):
        return False
    if ms:
        UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + ms)
    return True


def reclaim(*, slot: Reservation, charge_ms: int) -> None:
    """ACTIVE -> RECLAIMED: a run whose lease expired (its worker died, or froze) is charged
    `charge_ms` (what it reported) and its slot and reservation are given back; if it turns out to
    be alive after all, its settlement charges only the rest. What the slot carried of the runs it
    was passed on from is charged with it. Under the lock, `slot` read with its row locked."""
    charge_day(slot, cpu_ms=charge_ms, reserved_ms=slot.cpu_reserved_ms, runs=1)
    Reservation.objects.filter(pk=slot.pk).update(status=ReservationStatus.RECLAIMED, cpu_charged_ms=charge_ms,
                                                  **NOTHING_CARRIED)


def revive(*, slot_id: int, account_id: int, queue: str, reserve_ms: int) -> int | None:
    """RECLAIMED -> ACTIVE: the run of a slot reclaimed while its worker was frozen past its lease
    woke up, and its account has a free slot: the slot is its again, `reserve_ms` reserved, the run
    no longer counted twice (the reclaim counted it, its settlement will) nor marked lost. What the
    reclaim charged stays charged (its settlement charges the rest). Under the lock, which saw the
    free slot. Returns the slot's CPU charged so far, None when it is not reclaimed (it settled, or
    its row went)."""
    slot = Reservation.objects.select_for_update().filter(pk=slot_id, status=ReservationStatus.RECLAIMED).first()
    if slot is None:
        return None
    Reservation.objects.filter(pk=slot_id).update(status=ReservationStatus.ACTIVE, cpu_reserved_ms=reserve_ms,
                                                  lease_expires_at=standing.run_lease_expiry())
    UsageDay.objects.filter(account_id=account_id, queue=queue, day=slot.day).update(
        runs=F("runs") - 1, cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
    if slot.task_run_id:
        task_run_mark_running_again(run_id=slot.task_run_id)
    return slot.cpu_charged_ms
