"""The statements a run's admission and settlement send, hand-written so that each task pays as few round trips
as possible (bench/budget_overhead.py counts them): the reservation is deleted and returned in
one statement, the account's usage for its day is charged in one more, which also tells what the
settlement needs to know next (is work held for this account; is any held work on the queue
waiting for a worker at all) without a further query. For PostgreSQL and SQLite alike (both have
DELETE/UPDATE ... RETURNING). Called under the account's Budget row lock (budgets.standing).
"""
import datetime as dt
from dataclasses import dataclass

from django.db import connection
from django.db.models import F

from budgets import standing
from budgets.models import Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import DeferredTask

_DELETE_SQL = f"""
DELETE FROM {Reservation._meta.db_table} WHERE id = %s
RETURNING task_run_id, day, status, cpu_reserved_ms, cpu_charged_ms
"""

# `held`: anything in the holding area for this account and queue (what release and hand-off
# act on); `waiting`: any eligible, unclaimed held job on the queue (what a pull could claim).
_CHARGE_SQL = """
UPDATE {usage} SET cpu_used_ms = cpu_used_ms + %s, cpu_reserved_ms = cpu_reserved_ms - %s,
       wall_ms = wall_ms + %s, db_wait_ms = db_wait_ms + %s, storage_wait_ms = storage_wait_ms + %s,
       runs = runs + %s, cap_hits = cap_hits + %s
 WHERE account_id = %s AND queue = %s AND day = %s
RETURNING EXISTS (SELECT 1 FROM {deferred} d WHERE d.account_id = %s AND d.queue = %s),
          EXISTS (SELECT 1 FROM {deferred} d WHERE d.queue = %s AND d.eligible_at <= %s
                   AND (d.claim_expires_at IS NULL OR d.claim_expires_at < %s))
""".format(usage=UsageDay._meta.db_table, deferred=DeferredTask._meta.db_table)


_RESERVE_SQL = f"UPDATE {UsageDay._meta.db_table} SET cpu_reserved_ms = cpu_reserved_ms + %s WHERE id = %s"
_SLOT_COLUMNS = ("status", "day", "task_run_id", "worker", "cpu_reserved_ms", "lease_expires_at")
_SLOT_SQL = (f"UPDATE {Reservation._meta.db_table} SET " + ", ".join(f"{c} = %s" for c in _SLOT_COLUMNS)
             + " WHERE id = %s")


def reserve(*, usage_id: int, reserve_ms: int, reservation_id: int, slot: dict) -> None:
    """Add `reserve_ms` to the day's reserved CPU and write `slot` (the columns of `_SLOT_COLUMNS`)
    to the reservation: two rows of two tables, independent of each other, so on PostgreSQL one
    statement (a data-modifying WITH: both see the same snapshot, which is all either needs)."""
    usage_params = [reserve_ms, usage_id]
    ops = connection.ops
    slot = {**slot, "day": ops.adapt_datefield_value(slot["day"]),
            "lease_expires_at": ops.adapt_datetimefield_value(slot["lease_expires_at"])}
    slot_params = [slot[c] for c in _SLOT_COLUMNS] + [reservation_id]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"WITH u AS ({_RESERVE_SQL} RETURNING 1) {_SLOT_SQL}", usage_params + slot_params)
        else:
            cursor.execute(_RESERVE_SQL, usage_params)
            cursor.execute(_SLOT_SQL, slot_params)


def take_slot(
    *, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None, reserve_ms: int,
    task_run_id: int | None, worker: str,
) -> int:
    """Reserve the run's CPU on its day and make its slot (its own dispatched one, or a new one)
    ACTIVE; returns the slot's id."""
    usage_id = standing.usage_id(state, account_id=envelope.account, queue=queue, day=day)
    slot = {"status": ReservationStatus.ACTIVE, "day": day, "task_run_id": task_run_id, "worker": worker,
            "cpu_reserved_ms": reserve_ms, "lease_expires_at": standing.run_lease_expiry()}
    if own is not None:
        reserve(usage_id=usage_id, reserve_ms=reserve_ms, reservation_id=own, slot=slot)
        return own
    UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
    return Reservation.objects.create(account_id=envelope.account, queue=queue, job=envelope.job, ref=envelope.ref,
                                      **slot).pk


@dataclass(frozen=True)
class Charged:
    """What a settlement charged, and what it saw of the holding area while it did."""

    task_run_id: int | None
    was_active: bool  # it ran (admitted); else it was only dispatched or claimed
    held: bool = True  # (unknown, when no usage row was there to charge: assume there is)
    waiting: bool = True


def charge(*, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool,
           now: dt.datetime) -> Charged | None:
    """Delete the reservation and charge the run's figures to its day; None when it was settled
    already (exactly once: the second settlement finds no reservation)."""
    now = connection.ops.adapt_datetimefield_value(now)
    with connection.cursor() as cursor:
        cursor.execute(_DELETE_SQL, [reservation_id])
        row = cursor.fetchone()
        if row is None:
            return None
        task_run_id, day, status, reserved_ms, charged_ms = row
        was_active = status == ReservationStatus.ACTIVE
        cursor.execute(_CHARGE_SQL, [
            # A reclaimed run was already charged what it had reported; charge the rest.
            max(0, meter.cpu_ms - charged_ms), reserved_ms if was_active else 0, meter.wall_ms,
            round(meter.db_wait_ms), round(meter.storage_wait_ms), 1 if was_active else 0, 1 if cap_hit else 0,
            account_id, queue, day, account_id, queue, queue, now, now,
        ])
        flags = cursor.fetchone()
    if flags is None:
        return Charged(task_run_id, was_active)
    return Charged(task_run_id, was_active, held=bool(flags[0]), waiting=bool(flags[1]))
