"""The transitions of a running slot's lease: its watcher renews it (and grows its reservation); once
it expired the reclaim takes the slot back (RECLAIMED), and a run that turns out to be alive may
get it back (`revive`). Under the account's lock but `renew` (budgets.running, budgets.reclaim).
Their statements are queries.sql's `grow`, `reclaim`, `revive`; `renew` is one ORM update.

Cost: rows by key (the slot, the account's usage row of the slot's day, its run).
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
    """ACTIVE -> ACTIVE: `ms` more CPU reserved for a running slot, which also renews its lease; the
    caller (under the lock) decided the account has it. False when the slot is gone."""
    return db.fetch_one(QUERIES["grow"], {"slot_id": slot_id, "usage_id": usage_id, "cpu_ms": cpu_ms, "ms": ms,
                                          "lease": standing.run_lease_expiry()}) is not None


def reclaim(*, slot: Reservation, charge_ms: int) -> None:
    """ACTIVE -> RECLAIMED: a run whose lease expired (its worker died, or froze) is charged
    `charge_ms` (what it reported) and its slot and reservation are given back; if it turns out to
    be alive after all, its settlement charges only the rest. What the slot carried of the runs it
    was passed on from is charged with it. Under the lock, `slot` read with its row locked."""
    db.fetch_one(QUERIES["reclaim"], {"slot_id": slot.pk, "charge_ms": charge_ms})


def revive(*, slot_id: int, account_id: int, queue: str, reserve_ms: int) -> int | None:
    """RECLAIMED -> ACTIVE: the run of a slot reclaimed while its worker was frozen past its lease
    woke up, and its account (`account_id` on `queue`) has a free slot: the slot is its again,
    `reserve_ms` reserved, the run no longer counted twice (the reclaim counted it, its settlement
    will) nor marked lost. What the reclaim charged stays charged (its settlement charges the
    rest). Under the lock, which saw the free slot. Returns the slot's CPU charged so far, None
    when it is not reclaimed (it settled, or its row went)."""
    row = db.fetch_one(QUERIES["revive"], {"slot_id": slot_id, "reserve_ms": reserve_ms,
                                           "lease": standing.run_lease_expiry()})
    return None if row is None else row[0]
