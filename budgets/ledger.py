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

# The deleted reservation's figures come from `r`: the DELETE's own result (a WITH on PostgreSQL)
# or its values (elsewhere). A reclaimed run was already charged what it had reported (its
# cpu_charged_ms): charge the rest. Only a run that was admitted (ACTIVE) reserved CPU and counts.
_CHARGE_SQL = """
UPDATE {usage} AS u
   SET cpu_used_ms = u.cpu_used_ms + CASE WHEN %s > r.cpu_charged_ms THEN %s - r.cpu_charged_ms ELSE 0 END,
       cpu_reserved_ms = u.cpu_reserved_ms - CASE WHEN r.status = %s THEN r.cpu_reserved_ms ELSE 0 END,
       runs = u.runs + CASE WHEN r.status = %s THEN 1 ELSE 0 END,
       wall_ms = u.wall_ms + %s, db_wait_ms = u.db_wait_ms + %s, storage_wait_ms = u.storage_wait_ms + %s,
       cap_hits = u.cap_hits + %s
  FROM {{r}} WHERE u.account_id = %s AND u.queue = %s AND u.day = r.day
""".format(usage=UsageDay._meta.db_table)
_R_VALUES = "(SELECT %s AS day, %s AS status, %s AS cpu_reserved_ms, %s AS cpu_charged_ms) AS r"

# `held`: anything in the holding area for this account and queue (what release and hand-off
# act on); `waiting`: any eligible, unclaimed held job on the queue (what a pull could claim).
_FLAGS_SQL = """
EXISTS (SELECT 1 FROM {deferred} d WHERE d.account_id = %s AND d.queue = %s),
EXISTS (SELECT 1 FROM {deferred} d WHERE d.queue = %s AND d.eligible_at <= %s
         AND (d.claim_expires_at IS NULL OR d.claim_expires_at < %s))
""".format(deferred=DeferredTask._meta.db_table)
# PostgreSQL: the whole settlement's ledger in one statement (the WITH parts see one snapshot,
# taken after the caller's lock was granted; the UPDATE reads the deleted row through `r`).
_SETTLE_SQL = (f"WITH r AS ({_DELETE_SQL}), c AS ({_CHARGE_SQL.format(r='r')} RETURNING 1) "
               f"SELECT r.task_run_id, r.status, {_FLAGS_SQL} FROM r")


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
    held: bool  # work is held for the account on this queue
    waiting: bool  # held work of the queue waits for a worker


def charge(*, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool,
           now: dt.datetime) -> Charged | None:
    """Delete the reservation and charge the run's figures to its day; None when it was settled
    already (exactly once: the second settlement finds no reservation)."""
    now = connection.ops.adapt_datetimefield_value(now)
    cpu, active = meter.cpu_ms, ReservationStatus.ACTIVE
    set_params = [cpu, cpu, active, active, meter.wall_ms, round(meter.db_wait_ms), round(meter.storage_wait_ms),
                  1 if cap_hit else 0]
    where_params, flag_params = [account_id, queue], [account_id, queue, queue, now, now]
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(_SETTLE_SQL, [reservation_id, *set_params, *where_params, *flag_params])
            row = cursor.fetchone()
            if row is None:
                return None
            task_run_id, status, held, waiting = row
        else:
            cursor.execute(_DELETE_SQL, [reservation_id])
            row = cursor.fetchone()
            if row is None:
                return None
            task_run_id, day, status, reserved_ms, charged_ms = row
            cursor.execute(_CHARGE_SQL.format(r=_R_VALUES),
                           [*set_params, day, status, reserved_ms, charged_ms, *where_params])
            cursor.execute(f"SELECT {_FLAGS_SQL}", flag_params)
            held, waiting = cursor.fetchone()
    return Charged(task_run_id, status == active, held=bool(held), waiting=bool(waiting))
