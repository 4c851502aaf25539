"""The transitions of a running slot's lease: its watcher renews it (and grows its reservation);
once it expired the reclaim takes the slot back (RECLAIMED), and a run that turns out to be alive
may get it back (`revive`). Under the account's lock but `renew` (budgets.running, budgets.reclaim).
Rows by key.
"""
from budgets import standing
from budgets.ledger.reads import QUERIES
from budgets.models import Reservation, ReservationStatus
from scheduling import db


def renew(*, slot_id: int, cpu_ms: int) -> bool:
    """ACTIVE -> ACTIVE: a running slot reports its CPU and renews its lease; False when the slot is
    no longer the run's (it was reclaimed while its worker was frozen, or settled)."""
    return Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry()) == 1


def grow(*, slot_id: int, usage_id: int, cpu_ms: int, ms: int) -> bool:
    """ACTIVE -> ACTIVE: `renew`, and `ms` more CPU reserved (the lock saw the account has it).
    False when the slot is gone."""
    return db.fetch_one(QUERIES["grow"], {"slot_id": slot_id, "usage_id": usage_id, "cpu_ms": cpu_ms, "ms": ms,
                                          "lease": standing.run_lease_expiry()}) is not None


def reclaim(*, slot: Reservation, charge_ms: int) -> None:
    """ACTIVE -> RECLAIMED: a run whose lease expired (its worker died, or froze) is charged
    `charge_ms` (what it reported), its slot and reservation given back; `slot` read with its row
    locked."""
    db.fetch_one(QUERIES["reclaim"], {"slot_id": slot.pk, "charge_ms": charge_ms})


def revive(*, slot_id: int, account_id: int, queue: str, reserve_ms: int) -> int | None:
    """RECLAIMED -> ACTIVE: a reclaimed run's frozen worker woke up, and its account (`account_id`
    on `queue`) has a free slot (the lock saw it): the slot is its again, `reserve_ms` reserved.
    Returns the slot's CPU charged so far, None when it is not reclaimed."""
    row = db.fetch_one(QUERIES["revive"], {"slot_id": slot_id, "reserve_ms": reserve_ms,
                                           "lease": standing.run_lease_expiry()})
    return None if row is None else row["cpu_charged_ms"]
