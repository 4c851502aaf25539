"""An account's standing on one queue (budget, today's usage, slots, held work), read in one
statement under the row lock of its Budget, and the slot and lease helpers built on it.

Every write to an account's usage ledger and slots that can refuse work happens under the row
lock of its Budget (account, queue): admission, reservation growth, reclaim, hand-off, release and
the enqueue-time check's slow path serialise per account and queue, so caps hold and counts
never drift. Three statements go without it and still cannot pass a cap: a settlement's charge,
which only frees (budgets.services.settle; a slot it frees can still never miss a job that is
just being put on hold — no lost wake-ups: both sides look again once they committed, and one of
them sees the other); its pass-on, which swaps one slot and its reservation for another
(budgets.ledger.charge); and the admission of a sent job, which proves by the Budget row's version
that no lock holder committed since its snapshot and holds that row to its commit
(budgets.ledger.admit_at_once).

A slot is a Reservation row: DISPATCHED from the moment the job is sent to the broker until it
starts, ACTIVE while it runs. CPU is reserved in steps (RESERVATION_STEP_MS, at least the job's
estimate) and only from what the account has left, so its runs together cannot spend more than
the daily cap however many run at once.
"""
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from scheduling import db
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask
from scheduling.holding import CLAIM_HELD_SQL
from scheduling.pausing import COVERED_SQL

IN_FLIGHT = (ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE)


@dataclass(frozen=True)
class Standing:
    """An account's standing on one queue today, read in one statement."""

    cpu_limit_ms: int
    max_concurrent: int
    usage_id: int | None
    cpu_used_ms: int
    cpu_reserved_ms: int
    in_flight: int | None  # slots taken: dispatched or running (None: not counted, the job has a slot of its own)
    active: int  # running
    held: bool  # anything in the holding area on this queue
    own_slot: int | None = None  # the job's own dispatched Reservation, when asked for a job
    paused: bool = False  # a pause covers the account's work on this queue (scheduling.pausing)
    claimed: bool = False  # the worker asked about still holds its claim on the job (scheduling.holding)

    @property
    def unreserved_ms(self) -> int:
        return self.cpu_limit_ms - self.cpu_used_ms - self.cpu_reserved_ms

    @property
    def free_slots(self) -> int:
        if self.in_flight is None:
            raise ValueError("slots were not counted: the standing was read for a job that holds a slot of its own")
        return self.max_concurrent - self.in_flight


# Is anything of the account's held on the queue: SQL for hand-written statements, with
# `account` and `queue` filled in (`held`, the standing, the enqueue check, the settlement).
HELD_SQL = (f"EXISTS (SELECT 1 FROM {DeferredTask._meta.db_table} d "
            "WHERE d.account_id = {account} AND d.queue = {queue})")

# One hand-written statement (for PostgreSQL and SQLite alike): it runs at the start of
# every task, and building the same query through the ORM cost more CPU than running it.
# A job's own dispatched slot is found through its (job, ref) (in index `reservation_slots`). The
# slots taken are counted only for a job without one: a count reads every slot of the account, its
# whole backlog in the broker, and a job with a slot of its own never asks for a free one (CASE
# evaluates the count only then).
_OWN_SLOT_SQL = """(SELECT MIN(r.id) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status = %s AND r.job = %s AND r.ref = %s)
""".format(reservation=Reservation._meta.db_table)
_STATE_SQL = """
SELECT b.cpu_seconds_per_day, b.max_concurrent, u.id, COALESCE(u.cpu_used_ms, 0), COALESCE(u.cpu_reserved_ms, 0),
       CASE WHEN {own} IS NULL THEN (SELECT COUNT(*) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status IN (%s, %s)) END,
       (SELECT COUNT(*) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status = %s),
       {held},
       {own},
       {paused}, {claimed}
  FROM {budget} b
  LEFT JOIN {usage} u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %s
 WHERE b.account_id = %s AND b.queue = %s
""".format(reservation=Reservation._meta.db_table, held=HELD_SQL.format(account="b.account_id", queue="b.queue"),
           own=_OWN_SLOT_SQL, budget=Budget._meta.db_table, usage=UsageDay._meta.db_table,
           paused=COVERED_SQL.format(account="b.account_id", queue="b.queue"), claimed=CLAIM_HELD_SQL)


def read(
    *, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None, claim: str | None = None,
) -> Standing | None:
    """The budget, today's usage, the slots taken, whether work is held and (given an envelope)
    the slot that job was dispatched with and whether worker `claim` still holds its claim on it,
    in one query. For a job that holds a slot of its own the slots taken are not counted
    (`in_flight` is None): the cap on running jobs (`active`) is all its admission checks.

    Run after the Budget row lock was taken (`lock`), in a statement of its own, it sees
    everything committed before the lock was granted (READ COMMITTED: a new snapshot per statement).
    """
    job, ref = (envelope.job, envelope.ref) if envelope is not None else ("", "")
    with db.cursor() as cursor:
        own_slot = [ReservationStatus.DISPATCHED, job, ref]
        cursor.execute(_STATE_SQL, [
            *own_slot, ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE, ReservationStatus.ACTIVE,
            *own_slot, job, ref, claim, day.isoformat(), account_id, queue,
        ])
        row = cursor.fetchone()
    if row is None:
        return None
    cpu_seconds, max_concurrent, usage_id, used, reserved, in_flight, active, held, own_slot, paused, claimed = row
    return Standing(cpu_limit_ms=cpu_seconds * 1000, max_concurrent=max_concurrent, usage_id=usage_id,
                    cpu_used_ms=used, cpu_reserved_ms=reserved, in_flight=in_flight, active=active,
                    held=bool(held), own_slot=own_slot if envelope is not None else None, paused=bool(paused),
                    claimed=bool(claimed))


def held(*, account_id: int, queue: str) -> bool:
    """Whether anything of the account's is in the holding area on this queue (no lock)."""
    with db.cursor() as cursor:
        cursor.execute("SELECT " + HELD_SQL.format(account="%s", queue="%s"), [account_id, queue])
        return bool(cursor.fetchone()[0])


_LOCK_SQL = f"SELECT 1 FROM {Budget._meta.db_table} WHERE account_id = %s AND queue = %s"
# PostgreSQL: the lock is a write that changes nothing, so that the row gets a new version (a new
# xmin) each time it is locked: what a lock-free admission checks to know that no lock holder
# committed since its snapshot (`budgets.ledger.admit_at_once`).
_LOCK_BY_WRITE_SQL = (f"UPDATE {Budget._meta.db_table} SET max_concurrent = max_concurrent "
                      "WHERE account_id = %s AND queue = %s RETURNING 1")
_LOCK_BY_WRITE_SKIP_LOCKED_SQL = (
    f"UPDATE {Budget._meta.db_table} SET max_concurrent = max_concurrent WHERE id = "
    f"(SELECT id FROM {Budget._meta.db_table} WHERE account_id = %s AND queue = %s FOR UPDATE SKIP LOCKED) "
    "RETURNING 1")


def lock(*, account_id: int, queue: str, skip_locked: bool = False) -> bool:
    """Lock the account's Budget row on this queue; False when it has none (nothing locked), or,
    with `skip_locked`, when another transaction holds it. On PostgreSQL by writing it (see
    _LOCK_BY_WRITE_SQL). (SQLite has no row locks: its transactions serialise writers as a whole.)"""
    if connection.vendor == "postgresql":
        sql = _LOCK_BY_WRITE_SKIP_LOCKED_SQL if skip_locked else _LOCK_BY_WRITE_SQL
    else:
        sql = _LOCK_SQL
    with db.cursor() as cursor:
        cursor.execute(sql, [account_id, queue])
        return cursor.fetchone() is not None


def usage_id(state: Standing, *, account_id: int, queue: str, day: dt.date) -> int:
    if state.usage_id is not None:
        return state.usage_id
    usage, _ = UsageDay.objects.get_or_create(account_id=account_id, queue=queue, day=day)
    return usage.pk


def step_ms(estimate_ms: int) -> int:
    """What an admitted run reserves at first when its account has that much left: a step, or its
    job's estimate when larger."""
    return max(estimate_ms, settings.FAIRSHARE["RESERVATION_STEP_MS"])


def first_reservation_ms(state: Standing, estimate_ms: int) -> int:
    """What an admitted run reserves at first: `step_ms`, at most what its account has left
    unreserved."""
    return min(step_ms(estimate_ms), state.unreserved_ms)


def out_of_budget(state: Standing, now: dt.datetime) -> tuple[str, dt.datetime]:
    """Why an account with nothing left to reserve waits, and until when."""
    if state.active and state.unreserved_ms + state.cpu_reserved_ms > 0:
        # Its running jobs have reserved the rest; what they do not use comes back when they settle.
        return DeferReason.BUDGET_RESERVED, now
    return DeferReason.BUDGET_EXHAUSTED, clock.next_reset(now)


def run_lease_expiry() -> dt.datetime:
    """A running slot's lease: its watcher renews it; once it expires the slot is reclaimed."""
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["RESERVATION_LEASE_S"])


def dispatch_lease_expiry() -> dt.datetime:
    """A dispatched slot's lease: if its message has not started by then, it was lost."""
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])


# The enqueue-time check's common case in one statement and no lock (budgets.services.admit_at_enqueue):
# a dispatched slot for the job when its account has budget left today, a free slot on the queue,
# nothing held there and no slot of the job's own yet. The columns not named keep their defaults.
_DISPATCH_COLUMNS = ("(account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker, "
                     "cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms)")
_DISPATCH_IF_FREE_SQL = """
INSERT INTO {reservation} {columns}
SELECT b.account_id, b.queue, %s, %s, %s, %s, %s, %s, '', 0, 0, 0
  FROM {budget} b
  LEFT JOIN {usage} u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %s
 WHERE b.account_id = %s AND b.queue = %s
   AND CAST(b.cpu_seconds_per_day AS BIGINT) * 1000 > COALESCE(u.cpu_used_ms, 0) + COALESCE(u.cpu_reserved_ms, 0)
   AND b.max_concurrent > (SELECT COUNT(*) FROM {reservation} r
                            WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status IN (%s, %s))
   AND NOT {held}
   AND NOT EXISTS (SELECT 1 FROM {reservation} r WHERE r.account_id = b.account_id AND r.queue = b.queue
                      AND r.status = %s AND r.job = %s AND r.ref = %s)
RETURNING id
""".format(reservation=Reservation._meta.db_table, held=HELD_SQL.format(account="b.account_id", queue="b.queue"),
           budget=Budget._meta.db_table, usage=UsageDay._meta.db_table, columns=_DISPATCH_COLUMNS)


def dispatch_if_free(*, envelope: Envelope, queue: str, day: dt.date) -> bool:
    """Take a slot for a job on its way to the broker if its account plainly has room (see above);
    False when it has not, or when the job holds a slot already: the caller looks closer."""
    ops = connection.ops
    now = timezone.now()
    dispatched = ReservationStatus.DISPATCHED
    with db.cursor() as cursor:
        cursor.execute(_DISPATCH_IF_FREE_SQL, [
            ops.adapt_datefield_value(day), envelope.job, envelope.ref, dispatched,
            ops.adapt_datetimefield_value(now + dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])),
            ops.adapt_datetimefield_value(now), ops.adapt_datefield_value(day), envelope.account, queue,
            dispatched, ReservationStatus.ACTIVE, dispatched, envelope.job, envelope.ref,
        ])
        return cursor.fetchone() is not None


def dispatch_claimed_sql(*, claim: tuple[str, list], account_id: int, queue: str, day: dt.date,
                        lease_s: float) -> tuple[str, list]:
    """One statement (PostgreSQL) that runs `claim`, a data-modifying statement returning a held
    job's (job, ref, priority) (scheduling.holding.claim_oldest_sql), and takes a slot for the job it
    claimed, leased like the claim; it returns (job, ref, slot id, priority), or no row when nothing
    was claimed."""
    ops = connection.ops
    now = timezone.now()
    claim_sql, claim_params = claim
    sql = (f"WITH c AS ({claim_sql}) INSERT INTO {Reservation._meta.db_table} {_DISPATCH_COLUMNS} "
           "SELECT %s, %s, %s, c.job, c.ref, %s, %s, %s, '', 0, 0, 0 FROM c RETURNING job, ref, id, "
           "(SELECT priority FROM c)")
    return sql, [*claim_params, account_id, queue, ops.adapt_datefield_value(day), ReservationStatus.DISPATCHED,
                 ops.adapt_datetimefield_value(now + dt.timedelta(seconds=lease_s)), ops.adapt_datetimefield_value(now)]


def dispatch(*, envelope: Envelope, queue: str, day: dt.date, lease_s: float | None = None) -> Reservation:
    """Take a slot for a job on its way to the broker (or claimed by a worker, for `lease_s`)."""
    expires = dispatch_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
    return Reservation.objects.create(
        account_id=envelope.account, queue=queue, day=day, job=envelope.job, ref=envelope.ref,
        status=ReservationStatus.DISPATCHED, lease_expires_at=expires,
    )
