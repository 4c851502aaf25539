"""The ledger statements of a run's admission and settlement, hand-written so that each task pays
as few round trips as possible (bench/budget_overhead.py counts them).

- Admission (`take_slot`, under the account's Budget row lock, budgets.standing, in the caller's
  transaction): the CPU reserved on the day, the slot made ACTIVE, the run's record inserted and a
  claimed job's claim completed (their SQL from scheduling: it owns those tables).
- Settlement (`charge`, atomic on its own and taking no lock: budgets.services.settle says why
  that is safe): the reservation deleted (exactly once: RETURNING says whether it was
  there), its run's figures charged to its day and recorded on its run, and what the settlement
  needs to know next (is work held for this account; does any held work of the queue wait for a
  worker) read with it.

Each is one statement on PostgreSQL (a data-modifying WITH); SQLite runs the same parts one by
one (it has DELETE/UPDATE ... RETURNING and UPDATE ... FROM, but no WITH around them).
"""
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from budgets import standing
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling import db
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.holding import claim_complete_sql, claim_oldest_sql
from scheduling.pausing import COVERED_SQL
from scheduling.models import DeferredTask, TaskRun
from scheduling.services import task_run_insert_sql

_DELETE_SQL = f"""
DELETE FROM {Reservation._meta.db_table} WHERE id = %s
RETURNING task_run_id, day, status, cpu_reserved_ms, cpu_charged_ms, id
"""

# The deleted reservation's figures come from `r`: the DELETE's own result (a WITH on PostgreSQL)
# or its values (elsewhere). A reclaimed run was already charged what it had reported (its
# cpu_charged_ms): charge the rest. Only a run that was admitted (ACTIVE) reserved CPU and counts.
_CHARGE_SQL = """
UPDATE {usage} AS u
   SET cpu_used_ms = u.cpu_used_ms + CASE WHEN %s > r.cpu_charged_ms THEN %s - r.cpu_charged_ms ELSE 0 END,
       cpu_reserved_ms = u.cpu_reserved_ms - CASE WHEN r.status = %s THEN r.cpu_reserved_ms ELSE 0 END{{kept}},
       runs = u.runs + CASE WHEN r.status = %s THEN 1 ELSE 0 END,
       wall_ms = u.wall_ms + %s, db_wait_ms = u.db_wait_ms + %s, storage_wait_ms = u.storage_wait_ms + %s,
       cap_hits = u.cap_hits + %s
  FROM {{r}} WHERE u.account_id = %s AND u.queue = %s AND u.day = r.day
""".format(usage=UsageDay._meta.db_table)
_R_VALUES = "(SELECT %s AS day, %s AS status, %s AS cpu_reserved_ms, %s AS cpu_charged_ms) AS r"

# `held`: anything in the holding area for this account and queue (what release and hand-off
# act on); `waiting`: any eligible, unclaimed held job on the queue (what a pull could claim).
_FLAGS_SQL = """
{held},
EXISTS (SELECT 1 FROM {deferred} d WHERE d.queue = %s AND d.eligible_at <= %s
         AND (d.claim_expires_at IS NULL OR d.claim_expires_at < %s))
""".format(held=standing.HELD_SQL.format(account="%s", queue="%s"), deferred=DeferredTask._meta.db_table)
# PostgreSQL: the account's standing after the settlement (budgets.standing.Standing, less what the
# hand-off and release do not use), read with it: the day charged, as `c` returns it, and the
# slots but the one deleted (every part of the statement sees the snapshot from before it).
_AFTER_SQL = """b.cpu_seconds_per_day, b.max_concurrent, c.id, c.day, c.cpu_used_ms, c.cpu_reserved_ms, {paused},
(SELECT COUNT(*) FROM {reservation} x WHERE x.account_id = b.account_id AND x.queue = b.queue
    AND x.status IN (%s, %s) AND x.id <> r.id),
(SELECT COUNT(*) FROM {reservation} x WHERE x.account_id = b.account_id AND x.queue = b.queue
    AND x.status = %s AND x.id <> r.id)""".format(reservation=Reservation._meta.db_table,
                                                  paused=COVERED_SQL.format(account="b.account_id", queue="b.queue"))
# The whole settlement's ledger in one statement (the WITH parts see one snapshot, taken after the
# caller's lock was granted; the UPDATEs read the deleted row through `r`). Only a settlement under
# the lock reads the standing after it: the slot counts read every slot of the account, its whole
# backlog in the broker, and the lock-free settlement has no use for them.
_SETTLE_WITH = (f"WITH r AS ({_DELETE_SQL}), "
                f"c AS ({_CHARGE_SQL.format(r='r', kept='')} RETURNING u.id, u.day, u.cpu_used_ms, u.cpu_reserved_ms), "
                f"t AS ({{run}}) ")
_SETTLE_SQL = _SETTLE_WITH + f"SELECT r.task_run_id, r.status, {_FLAGS_SQL} FROM r"
_SETTLE_AND_READ_SQL = (_SETTLE_WITH + f"SELECT r.task_run_id, r.status, {_FLAGS_SQL}, {_AFTER_SQL} FROM r "
                        f"LEFT JOIN c ON TRUE JOIN {Budget._meta.db_table} b ON b.account_id = %s AND b.queue = %s")
_RUN_OF_R = "(SELECT task_run_id FROM r)"

# A lock-free settlement that passes its slot on (PostgreSQL, `charge` with a `PassOn`): the same
# statement claims the account's oldest eligible held job (`h`: scheduling.holding.claim_oldest_sql,
# whose condition is `_PASS_ON_IF`), inserts its slot, active, with what is left of the run's
# reservation (`n`, `_KEPT_SQL`: at most a step) and its run's record (`s`), and unreserves only
# the rest (`c`). It needs no lock: its slots taken and running, and the account's used + reserved
# CPU, never grow (a slot goes, one comes; what is kept was reserved already), so nothing it does
# can pass a cap that an admission under the lock checked. The statement's snapshot serves only
# to refuse: a run of another day, a reservation with too little left, a pause, more running than
# the cap allows now (an operator lowered it: the slot is then freed, not passed on).
_KEPT_SQL = "LEAST(r.cpu_reserved_ms - %s, %s)"
_PASS_ON_IF = """(EXISTS (SELECT 1 FROM r WHERE r.status = %s AND r.day = %s AND r.cpu_charged_ms = 0
                     AND r.cpu_reserved_ms - %s >= %s)
  AND NOT {paused}
  AND (SELECT COUNT(*) FROM {reservation} x WHERE x.account_id = %s AND x.queue = %s AND x.status = %s
         AND x.id <> (SELECT id FROM r))
    < (SELECT b.max_concurrent FROM {budget} b WHERE b.account_id = %s AND b.queue = %s))""".format(
    paused=COVERED_SQL.format(account="%s", queue="%s"), reservation=Reservation._meta.db_table,
    budget=Budget._meta.db_table)
# The columns of a slot inserted for a claimed job, admitted (`claim_and_admit`, the pass-on).
_CLAIMED_SLOT_COLUMNS = ("account_id", "queue", "day", "job", "ref", "status", "lease_expires_at", "created_at",
                         "worker", "cpu_reserved_ms", "cpu_reported_ms", "cpu_charged_ms", "task_run_id")
_SETTLE_AND_PASS_ON_SQL = (
    f"WITH r AS ({_DELETE_SQL}), h AS ({{claim}}), "
    f"c AS ({_CHARGE_SQL.format(r='r', kept=f' + CASE WHEN EXISTS (SELECT 1 FROM h) THEN {_KEPT_SQL} ELSE 0 END')}"
    " RETURNING u.id), "
    "t AS ({run}), s AS ({new_run}), "
    f"n AS (INSERT INTO {Reservation._meta.db_table} ({', '.join(_CLAIMED_SLOT_COLUMNS)}) "
    f"SELECT %s, %s, r.day, h.job, h.ref, %s, %s, %s, %s, {_KEPT_SQL}, 0, 0, (SELECT id FROM s) FROM h, r "
    "RETURNING job, ref, id, task_run_id, cpu_reserved_ms) "
    f"SELECT r.task_run_id, r.status, {_FLAGS_SQL}, n.job, n.ref, n.id, n.task_run_id, n.cpu_reserved_ms, "
    "(SELECT id FROM c), (SELECT priority FROM h) FROM r LEFT JOIN n ON TRUE")


_RESERVE_SQL = f"UPDATE {UsageDay._meta.db_table} SET cpu_reserved_ms = cpu_reserved_ms + %s WHERE id = %s"
_SLOT_COLUMNS = ("status", "day", "worker", "cpu_reserved_ms", "lease_expires_at")
_NEW_SLOT_COLUMNS = (*_SLOT_COLUMNS, "account_id", "queue", "job", "ref", "cpu_reported_ms", "cpu_charged_ms",
                     "created_at")


def _slot_sql(own: int | None, run_id_sql: str) -> str:
    """Make the job's own dispatched slot ACTIVE, or insert an ACTIVE one; RETURNING the slot's id
    and its run's (`run_id_sql`: a placeholder or a sub-select of the caller's statement)."""
    if own is not None:
        sets = ", ".join(f"{c} = %s" for c in _SLOT_COLUMNS)
        return (f"UPDATE {Reservation._meta.db_table} SET {sets}, task_run_id = {run_id_sql} "
                "WHERE id = %s RETURNING id, task_run_id")
    return (f"INSERT INTO {Reservation._meta.db_table} ({', '.join(_NEW_SLOT_COLUMNS)}, task_run_id) "
            f"VALUES ({', '.join(['%s'] * len(_NEW_SLOT_COLUMNS))}, {run_id_sql}) RETURNING id, task_run_id")


# PostgreSQL: the common admission — a job sent with a slot of its own, its account below its cap
# on running jobs with a step of budget left — in one statement without taking the lock first
# (`admit_at_once`). It writes the account's Budget row as the lock does (`b`), but only if the
# row is still the version its snapshot saw (`xmin`): every lock holder writes that row
# (budgets.standing.lock), so a later version means one committed since (or, waited for, just
# did) and whatever it counted is not in this snapshot; then nothing else happens. Holding that
# row to its commit, it decides on counts as exact as under the lock: the running slots (`s`,
# only a lock holder adds one; the lock-free settlement and pass-on never add to them), the own
# slot locked (`o`), and the budget by a conditional UPDATE of the day's usage row, checked on its
# latest version (`u`: the lock-free pass-on and `reserve_if_left` change it too). The run's
# record (`t`) and the slot made active (`k`) follow only from `u`.
_ADMIT_AT_ONCE_SQL = """
WITH b AS (
  UPDATE {budget} SET max_concurrent = max_concurrent
   WHERE account_id = %s AND queue = %s
     AND xmin = (SELECT xmin FROM {budget} WHERE account_id = %s AND queue = %s)
  RETURNING account_id, queue, cpu_seconds_per_day, max_concurrent),
o AS (
  SELECT r.id FROM {reservation} r
   WHERE r.id = (SELECT MIN(x.id) FROM {reservation} x WHERE x.account_id = %s AND x.queue = %s
                   AND x.status = %s AND x.job = %s AND x.ref = %s)
     AND r.status = %s
  FOR UPDATE),
s AS (
  SELECT o.id AS own_id, b.cpu_seconds_per_day FROM b, o
   WHERE (SELECT COUNT(*) FROM {reservation} x WHERE x.account_id = b.account_id AND x.queue = b.queue
            AND x.status = %s) < b.max_concurrent),
u AS (
  UPDATE {usage} SET cpu_reserved_ms = {usage}.cpu_reserved_ms + %s FROM s
   WHERE {usage}.account_id = %s AND {usage}.queue = %s AND {usage}.day = %s
     AND CAST(s.cpu_seconds_per_day AS BIGINT) * 1000 - {usage}.cpu_used_ms - {usage}.cpu_reserved_ms >= %s
  RETURNING {usage}.id),
t AS ({{run}}),
k AS (
  UPDATE {reservation} SET status = %s, day = %s, worker = %s, cpu_reserved_ms = %s, lease_expires_at = %s,
         task_run_id = (SELECT id FROM t)
   WHERE id = (SELECT own_id FROM s) AND EXISTS (SELECT 1 FROM u)
  RETURNING id, task_run_id)
SELECT EXISTS (SELECT 1 FROM b), (SELECT id FROM k), (SELECT task_run_id FROM k), {paused}
""".format(budget=Budget._meta.db_table, reservation=Reservation._meta.db_table, usage=UsageDay._meta.db_table,
           paused=COVERED_SQL.format(account="%s", queue="%s"))


# How many times `admit_at_once` tries when a lock holder committed since its statement's
# snapshot: again at once (a new snapshot sees that commit: the account's other worker admitting
# at the same moment, most of the time), then it leaves the job to the lock.
AT_ONCE_TRIES = 2


@dataclass(frozen=True)
class AdmittedAtOnce:
    """What `admit_at_once` did: `reservation_id` None when it admitted nothing (then the caller
    admits under the lock, which decides)."""

    reservation_id: int | None
    paused: bool = False


def admit_at_once(*, envelope: Envelope, queue: str, day: dt.date, reserve_ms: int, run: TaskRun,
                  worker: str) -> AdmittedAtOnce:
    """PostgreSQL: admit a job sent with a slot of its own in one statement without the lock
    (`_ADMIT_AT_ONCE_SQL`): its slot made active with `reserve_ms` reserved, `run` (not saved yet)
    inserted and `run.pk` set. Nothing when that is not plainly allowed — no slot of its own, its
    account at its cap on running jobs or with less than `reserve_ms` left today (or no usage row
    for the day yet), or a lock holder committed since the statement's snapshot."""
    ops = connection.ops
    account_id, dispatched, active = envelope.account, ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE
    run_sql, run_params = task_run_insert_sql(run, source="u")
    day_value = ops.adapt_datefield_value(day)
    lease = ops.adapt_datetimefield_value(standing.run_lease_expiry())
    sql = _ADMIT_AT_ONCE_SQL.format(run=run_sql)
    params = [
        account_id, queue, account_id, queue,
        account_id, queue, dispatched, envelope.job, envelope.ref, dispatched,
        active,
        reserve_ms, account_id, queue, day_value, reserve_ms,
        *run_params,
        active, day_value, worker, reserve_ms, lease,
        account_id, queue, queue,
    ]
    with db.cursor() as cursor:
        for _ in range(AT_ONCE_TRIES):
            cursor.execute(sql, params)
            fresh, slot_id, run_id, paused = cursor.fetchone()
            if fresh:
                break  # decided (admitted or not); else a lock holder committed since its snapshot
    if slot_id is None:
        return AdmittedAtOnce(None)
    run.pk = run_id
    return AdmittedAtOnce(slot_id, paused=bool(paused))


def take_slot(
    *, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None, reserve_ms: int,
    run: TaskRun | None, worker: str, claim: str | None = None, lease_s: float | None = None,
) -> int:
    """Reserve the run's CPU on its day, make its slot (its own dispatched one, or a new one)
    ACTIVE, for a `run` not saved yet insert its record (setting `run.pk`), and for a job claimed
    by worker `claim` complete the claim; returns the slot's id. Its lease is a running slot's, or
    `lease_s` (a job admitted ahead, until it starts: `start_claimed`). Rows of four tables, independent
    of each other: on PostgreSQL one statement (a data-modifying WITH: its parts see one snapshot,
    all any of them needs)."""
    usage_id = standing.usage_id(state, account_id=envelope.account, queue=queue, day=day)
    ops = connection.ops
    slot = {"status": ReservationStatus.ACTIVE, "day": ops.adapt_datefield_value(day), "worker": worker,
            "cpu_reserved_ms": reserve_ms,
            "lease_expires_at": ops.adapt_datetimefield_value(
                standing.run_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s))}
    if own is not None:
        slot_params = [slot[c] for c in _SLOT_COLUMNS]
    else:
        slot.update(account_id=envelope.account, queue=queue, job=envelope.job, ref=envelope.ref, cpu_reported_ms=0,
                    cpu_charged_ms=0, created_at=ops.adapt_datetimefield_value(timezone.now()))
        slot_params = [slot[c] for c in _NEW_SLOT_COLUMNS]
    insert_run = run is not None and run.pk is None
    run_sql, run_params = task_run_insert_sql(run) if insert_run else ("", [])
    own_params = [own] if own is not None else []
    claim_sql, claim_params = (claim_complete_sql(job=envelope.job, ref=envelope.ref, worker=claim)
                               if claim is not None else ("", []))
    with db.cursor() as cursor:
        if connection.vendor == "postgresql":
            parts = ([f"u AS ({_RESERVE_SQL} RETURNING 1)"] + ([f"t AS ({run_sql})"] if insert_run else [])
                     + ([f"k AS ({claim_sql} RETURNING 1)"] if claim_sql else []))
            slot_sql = _slot_sql(own, "(SELECT id FROM t)" if insert_run else "%s")
            cursor.execute(f"WITH {', '.join(parts)} {slot_sql}",
                           [reserve_ms, usage_id, *run_params, *claim_params, *slot_params,
                            *([] if insert_run else [run.pk if run else None]), *own_params])
            slot_id, run_id = cursor.fetchone()
        else:
            cursor.execute(_RESERVE_SQL, [reserve_ms, usage_id])
            if claim_sql:
                cursor.execute(claim_sql, claim_params)
            if insert_run:
                cursor.execute(run_sql, run_params)
                run_id = cursor.fetchone()[0]
            else:
                run_id = run.pk if run else None
            cursor.execute(_slot_sql(own, "%s"), [*slot_params, run_id, *own_params])
            slot_id = cursor.fetchone()[0]
    if insert_run:
        run.pk = run_id
    return slot_id


@dataclass(frozen=True)
class Charged:
    """What a settlement charged, and what it saw of the holding area while it did."""

    task_run_id: int | None
    was_active: bool  # it ran (admitted); else it was only dispatched or claimed
    held: bool  # work is held for the account on this queue
    waiting: bool  # held work of the queue waits for a worker
    after: Standing | None = None  # the account's standing on `day` after it, when read with it
    day: dt.date | None = None
    passed: "Passed | None" = None  # the held job its slot was passed on to (`PassOn`)


@dataclass(frozen=True)
class PassOn:
    """Asks a lock-free settlement (`charge`) to pass the run's slot on to its account's oldest
    eligible held job, claimed for `worker` for `lease_s` (until it starts: `start_claimed`),
    unless the SQL condition `unless` holds (budgets.handoff: a job sent to the broker waits)."""

    worker: str
    day: dt.date  # today: a run charged to another day frees its slot instead
    lease_s: float
    unless: tuple[str, list]


@dataclass(frozen=True)
class Passed:
    """The held job a settlement passed its slot on to, admitted: its slot (active, with `reserved_ms`
    of the run's reservation kept for it, on the day's usage row `usage_id`) and its run, recorded."""

    job: str
    ref: str
    reservation_id: int
    run: TaskRun
    reserved_ms: int
    usage_id: int
    priority: int


def charge(*, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool,
           now: dt.datetime, finished: Callable[[str], tuple[str, list]], read_after: bool = False,
           pass_on: PassOn | None = None) -> Charged | None:
    """Delete the reservation, charge the run's figures to its day and record them on its run
    (`finished(run_id_sql)`: scheduling.services.task_run_finished_sql); None when it was settled
    already (exactly once: the second settlement finds no reservation). Atomic on its own (one
    statement; elsewhere its parts in one transaction), so it needs no caller's transaction.
    With `read_after` (a caller holding the lock) it reads the account's standing after it too,
    on PostgreSQL in the same statement (`Charged.after`). With `pass_on` (PostgreSQL, no lock) it
    passes the run's slot on in the same statement when it may (`_SETTLE_AND_PASS_ON_SQL`:
    `Charged.passed`), else frees it as without."""
    if pass_on is not None and connection.vendor == "postgresql":
        return _charge_and_pass_on(reservation_id=reservation_id, account_id=account_id, queue=queue, meter=meter,
                                   cap_hit=cap_hit, now=now, finished=finished, pass_on=pass_on)
    now = connection.ops.adapt_datetimefield_value(now)
    active = ReservationStatus.ACTIVE
    set_params = _settle_params(meter, cap_hit, [])
    where_params, flag_params = [account_id, queue], [account_id, queue, queue, now, now]
    with db.cursor() as cursor:
        if connection.vendor == "postgresql":
            run_sql, run_params = finished(_RUN_OF_R)
            params = [reservation_id, *set_params, *where_params, *run_params, *flag_params]
            if not read_after:
                cursor.execute(_SETTLE_SQL.format(run=run_sql), params)
                row = cursor.fetchone()
                if row is None:
                    return None
                task_run_id, status, held, waiting = row
                return Charged(task_run_id, status == active, held=bool(held), waiting=bool(waiting))
            cursor.execute(_SETTLE_AND_READ_SQL.format(run=run_sql),
                           [*params, *standing.IN_FLIGHT, ReservationStatus.ACTIVE, *where_params])
            row = cursor.fetchone()
            if row is None:
                return None
            task_run_id, status, held, waiting, cpu_seconds, max_concurrent, usage_id, day, used, reserved, paused, \
                in_flight, running = row
            after = Standing(cpu_limit_ms=cpu_seconds * 1000, max_concurrent=max_concurrent, usage_id=usage_id,
                             cpu_used_ms=used, cpu_reserved_ms=reserved, in_flight=in_flight, active=running,
                             held=bool(held), paused=bool(paused))
            return Charged(task_run_id, status == active, held=bool(held), waiting=bool(waiting), after=after, day=day)
        with transaction.atomic(savepoint=False):  # the statement's parts, one by one
            cursor.execute(_DELETE_SQL, [reservation_id])
            row = cursor.fetchone()
            if row is None:
                return None
            task_run_id, day, status, reserved_ms, charged_ms, _ = row
            cursor.execute(_CHARGE_SQL.format(r=_R_VALUES, kept=''),
                           [*set_params, day, status, reserved_ms, charged_ms, *where_params])
            if task_run_id:
                run_sql, run_params = finished("%s")
                cursor.execute(run_sql, [*run_params, task_run_id])
            cursor.execute(f"SELECT {_FLAGS_SQL}", flag_params)
            held, waiting = cursor.fetchone()
    return Charged(task_run_id, status == active, held=bool(held), waiting=bool(waiting))


def _settle_params(meter: Meter, cap_hit: bool, kept: list) -> list:
    """The parameters of _CHARGE_SQL's SET, with those of what it keeps (`kept`: [] or _KEPT_SQL's)."""
    cpu, active = meter.cpu_ms, ReservationStatus.ACTIVE
    return [cpu, cpu, active, *kept, active, meter.wall_ms, round(meter.db_wait_ms), round(meter.storage_wait_ms),
            1 if cap_hit else 0]


def _charge_and_pass_on(*, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool,
                        now: dt.datetime, finished: Callable[[str], tuple[str, list]], pass_on: PassOn) -> Charged | None:
    """`charge` that passes the slot on (`_SETTLE_AND_PASS_ON_SQL`), in one statement."""
    ops, active = connection.ops, ReservationStatus.ACTIVE
    step = settings.FAIRSHARE["RESERVATION_STEP_MS"]
    kept = [meter.cpu_ms, step]  # _KEPT_SQL's
    keep_at_least = max(1, step // 2)  # else it frees the slot: a run's watcher asks for more below that
    unless_sql, unless_params = pass_on.unless
    condition = (f"({unless_sql} OR NOT {_PASS_ON_IF})",
                 [*unless_params, active, ops.adapt_datefield_value(pass_on.day), meter.cpu_ms, keep_at_least,
                  account_id, queue, queue, account_id, queue, active, account_id, queue])
    claim_sql, claim_params = claim_oldest_sql(account_id=account_id, queue=queue, worker=pass_on.worker,
                                               lease_s=pass_on.lease_s, unless=condition)
    run_sql, run_params = finished(_RUN_OF_R)  # first: the next run starts when (not before) this one ended
    run = TaskRun(account_id=account_id, queue=queue, worker=pass_on.worker)
    new_run_sql, new_run_params = task_run_insert_sql(run, source="h", taken={"job": "h.job", "ref": "h.ref"})
    lease, now = (ops.adapt_datetimefield_value(now + dt.timedelta(seconds=pass_on.lease_s)),
                  ops.adapt_datetimefield_value(now))
    with db.cursor() as cursor:
        cursor.execute(_SETTLE_AND_PASS_ON_SQL.format(claim=claim_sql, run=run_sql, new_run=new_run_sql), [
            reservation_id, *claim_params, *_settle_params(meter, cap_hit, kept), account_id, queue, *run_params,
            *new_run_params, account_id, queue, active, lease, now, pass_on.worker, *kept,
            account_id, queue, queue, now, now,
        ])
        row = cursor.fetchone()
    if row is None:
        return None
    task_run_id, status, held, waiting, job, ref, slot_id, run.pk, reserved_ms, usage_id, priority = row
    passed = None
    if job is not None:
        run.job, run.ref = job, ref
        passed = Passed(job, ref, slot_id, run, reserved_ms, usage_id, priority)
    return Charged(task_run_id, status == active, held=bool(held), waiting=bool(waiting), passed=passed)


def reserve_if_left(*, reservation_id: int, usage_id: int, ms: int) -> bool:
    """PostgreSQL, no lock: reserve `ms` more for an admitted slot on its day's usage row when its
    account has that much left unreserved (checked by the UPDATE on the row's latest version, so
    two of these never reserve the same budget twice); False when it has not."""
    with db.cursor() as cursor:
        cursor.execute(
            f"WITH u AS (UPDATE {UsageDay._meta.db_table} u SET cpu_reserved_ms = u.cpu_reserved_ms + %s "
            f"FROM {Budget._meta.db_table} b WHERE u.id = %s AND b.account_id = u.account_id AND b.queue = u.queue "
            "AND CAST(b.cpu_seconds_per_day AS BIGINT) * 1000 - u.cpu_used_ms - u.cpu_reserved_ms >= %s RETURNING 1) "
            f"UPDATE {Reservation._meta.db_table} SET cpu_reserved_ms = cpu_reserved_ms + %s "
            "WHERE id = %s AND EXISTS (SELECT 1 FROM u) RETURNING 1", [ms, usage_id, ms, ms, reservation_id])
        return cursor.fetchone() is not None


def start_claimed(*, reservation_id: int, envelope: Envelope, worker: str) -> bool:
    """A job admitted ahead with its claim (budgets.handoff) starts: its slot's lease becomes a
    running slot's and its claim completes (it leaves the holding area), together: on PostgreSQL
    one statement, which completes the claim only if the slot is still there. False when either
    is gone (the slot reclaimed, or the job held again, which voids a claim): it must not run."""
    claim_sql, claim_params = claim_complete_sql(job=envelope.job, ref=envelope.ref, worker=worker)
    lease = connection.ops.adapt_datetimefield_value(standing.run_lease_expiry())
    renew_sql = (f"UPDATE {Reservation._meta.db_table} SET lease_expires_at = %s WHERE id = %s AND status = %s"
                 " RETURNING id")
    renew_params = [lease, reservation_id, ReservationStatus.ACTIVE]
    with db.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"WITH s AS ({renew_sql}) {claim_sql} AND EXISTS (SELECT 1 FROM s) RETURNING 1",
                           [*renew_params, *claim_params])
            return cursor.fetchone() is not None
        cursor.execute(renew_sql, renew_params)
        if cursor.fetchone() is None:
            return False
        cursor.execute(claim_sql, claim_params)
        return cursor.rowcount > 0


def unadmit(*, reservation_id: int, account_id: int, queue: str, expired_before: dt.datetime | None = None,
            ) -> int | None:
    """Undo an admission whose run never started: its slot goes and its CPU is unreserved, nothing
    is charged or counted; with `expired_before`, only if its lease is still expired then (a start
    may have renewed it since it was read). Returns its run's id (None when the slot was not undone)."""
    lease = "" if expired_before is None else " AND lease_expires_at < %s"
    with db.cursor() as cursor:
        cursor.execute(f"DELETE FROM {Reservation._meta.db_table} WHERE id = %s AND status = %s{lease} "
                       "RETURNING day, cpu_reserved_ms, task_run_id",
                       [reservation_id, ReservationStatus.ACTIVE,
                        *([connection.ops.adapt_datetimefield_value(expired_before)] if expired_before else [])])
        row = cursor.fetchone()
        if row is None:
            return None
        day, reserved_ms, task_run_id = row
        cursor.execute(f"UPDATE {UsageDay._meta.db_table} SET cpu_reserved_ms = cpu_reserved_ms - %s "
                       "WHERE account_id = %s AND queue = %s AND day = %s", [reserved_ms, account_id, queue, day])
    return task_run_id


def claim_and_admit(
    *, claim: tuple[str, list], account_id: int, queue: str, state: Standing, day: dt.date, worker: str,
    reserve_ms: int, lease_s: float,
) -> tuple[str, str, int, TaskRun] | None:
    """PostgreSQL: run `claim` (scheduling.holding.claim_oldest_sql, returning a held job's job and
    ref) and admit the job it claimed, in one statement: its slot inserted active with `reserve_ms`
    reserved on the day, leased for `lease_s` (until it starts: `start_claimed`), its run recorded.
    Returns (job, ref, priority, slot id, run), or None when nothing was claimed."""
    ops = connection.ops
    now = timezone.now()
    usage_id = standing.usage_id(state, account_id=account_id, queue=queue, day=day)
    run = TaskRun(account_id=account_id, queue=queue, worker=worker)
    run_sql, run_params = task_run_insert_sql(run, source="c", taken={"job": "c.job", "ref": "c.ref"})
    claim_sql, claim_params = claim
    sql = (f"WITH c AS ({claim_sql}), t AS ({run_sql}), "
           f"u AS ({_RESERVE_SQL} AND EXISTS (SELECT 1 FROM c) RETURNING 1) "
           f"INSERT INTO {Reservation._meta.db_table} ({', '.join(_CLAIMED_SLOT_COLUMNS)}) "
           "SELECT %s, %s, %s, c.job, c.ref, %s, %s, %s, %s, %s, 0, 0, (SELECT id FROM t) FROM c "
           "RETURNING job, ref, id, task_run_id, (SELECT priority FROM c)")
    with db.cursor() as cursor:
        cursor.execute(sql, [
            *claim_params, *run_params, reserve_ms, usage_id,
            account_id, queue, ops.adapt_datefield_value(day), ReservationStatus.ACTIVE,
            ops.adapt_datetimefield_value(now + dt.timedelta(seconds=lease_s)), ops.adapt_datetimefield_value(now),
            worker, reserve_ms,
        ])
        row = cursor.fetchone()
    if row is None:
        return None
    job, ref, slot_id, run.pk, priority = row
    run.job, run.ref = job, ref
    return job, ref, priority, slot_id, run


def reserve_more(*, reservation_id: int, usage_id: int, ms: int) -> None:
    """PostgreSQL: reserve `ms` more for an admitted slot, on its day (the caller checked what is left)."""
    with db.cursor() as cursor:
        cursor.execute(f"WITH u AS ({_RESERVE_SQL} RETURNING 1) UPDATE {Reservation._meta.db_table} "
                       "SET cpu_reserved_ms = cpu_reserved_ms + %s WHERE id = %s", [ms, usage_id, ms, reservation_id])
