"""The settlement: ACTIVE (or DISPATCHED, RECLAIMED) -> (none). The charge of a run's slot to its
day, one statement without the lock (it only frees: a slot it frees is never missed by a job being
put on hold at the same moment, because both sides look again once they committed and one of them
sees the other: budgets.admission.wake_when_committed, the watcher's look); and the pass-on of the
slot to the account's next held job in the same statement, which may carry the run's charge on
instead (carried charges): it swaps one slot and its reservation for another, so slots taken and
running, and used + reserved CPU, stay as they were. The rules its statements share with the others
are budgets.ledger.statements'; above each statement, what it reads as held jobs, accounts and
history grow (EXPLAINed in tests/scheduling/test_held_work_cost.py).
"""
import datetime as dt

from django.conf import settings
from django.db.models import F
from django.utils import timezone

from budgets.ledger.reads import broker_window
from budgets.ledger.statements import (
    SLOT_COLUMNS, ACTIVE, B, R, U, broker_waiting, claim, compose, others_ready, running,
)
from budgets.ledger.values import Charged, Claimed, PassOn
from budgets.models import Reservation, ReservationStatus, UsageDay
from scheduling import db, sql
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.services import RunEnd, task_run_end_sql, task_run_insert_sql


def _charge_sql(*, kept: str = "0", unless: str = "FALSE") -> str:
    """The settlement's charge of the deleted slot `r` to its day: its CPU (what a reclaim charged
    already aside), giving back its reservation but `kept` (SQL: what a pass-on keeps for the next
    job), its waits, the run counted if it ran, and what the slot carried of the runs it was
    passed on from (their CPU moves from reserved to used); none of it when `unless` (SQL: the
    pass-on carries it all on instead). The usage row by key."""
    return f"""
UPDATE {U} AS u
   SET cpu_used_ms = u.cpu_used_ms + GREATEST(%(cpu_ms)s - r.cpu_charged_ms, 0) + r.carried_cpu_ms,
       cpu_reserved_ms = u.cpu_reserved_ms - CASE WHEN r.status = {ACTIVE} THEN r.cpu_reserved_ms ELSE 0 END
                         - r.carried_cpu_ms + {kept},
       runs = u.runs + CASE WHEN r.status = {ACTIVE} THEN 1 ELSE 0 END + r.carried_runs,
       wall_ms = u.wall_ms + %(wall_ms)s + r.carried_wall_ms,
       db_wait_ms = u.db_wait_ms + %(db_wait_ms)s + r.carried_db_wait_ms,
       storage_wait_ms = u.storage_wait_ms + %(storage_wait_ms)s + r.carried_storage_wait_ms,
       cap_hits = u.cap_hits + %(cap_hits)s
  FROM r WHERE NOT ({unless}) AND u.account_id = %(account_id)s AND u.queue = %(queue)s AND u.day = r.day
RETURNING u.id"""


DELETE_SLOT = (f"DELETE FROM {R} WHERE id = %(slot_id)s "
               "RETURNING task_run_id, day, status, cpu_reserved_ms, cpu_charged_ms, id, carried_runs, carried_cpu_ms, "
               "carried_wall_ms, carried_db_wait_ms, carried_storage_wait_ms, carried_since")
RUN_OF_R = "(SELECT task_run_id FROM r)"

# The settlement, no lock (it only frees): the slot deleted (exactly once: no row, nothing charged),
# its run charged and recorded (`t`), and whether the account has work in line and whether any
# account of the queue could go now (Backlog, by key and by index backlog_ready), and whether another
# account's turn comes first (`others_ready`), read with it.
SETTLE = (f"WITH r AS ({DELETE_SLOT}), c AS ({_charge_sql()}), t AS ({{run_end}}) "
          f"SELECT r.task_run_id, r.status, {sql.in_line(account='%(account_id)s', queue='%(queue)s')} AS in_line, "
          f"{sql.any_ready()} AS waiting, {others_ready()} AS others_waiting FROM r")

# What a pass-on keeps of the run's reservation for the next job: what it did not use, at most a step.
KEPT = "LEAST(r.cpu_reserved_ms - %(cpu_ms)s, %(step_ms)s)"
# When a settlement may pass its slot on (the composer's condition on its own `r`, given to the
# kernel's claim): a run of today that reserved from the day and left at least half a step, no
# pause, fewer running than the cap (an operator may have lowered it), no rate limit (decided under
# the lock), no other account's line that could go (then the slot goes by the fair order: a pull),
# no job waiting in the broker.
PASS_ON_IF = f"""EXISTS (SELECT 1 FROM r WHERE r.status = {ACTIVE} AND r.day = %(today)s AND r.cpu_charged_ms = 0
                      AND r.cpu_reserved_ms - %(cpu_ms)s >= %(keep_at_least)s)
  AND NOT {sql.paused(account='%(account_id)s', queue='%(queue)s')}
  AND {running(account='%(account_id)s', queue='%(queue)s', but='(SELECT id FROM r)')}
      < (SELECT max_concurrent FROM {B} WHERE account_id = %(account_id)s AND queue = %(queue)s AND rate_starts IS NULL)
  AND NOT {others_ready()}
  AND NOT {broker_waiting()}"""

# Carried charges: a pass-on whose run gives nothing back (what it did not use is all kept: at most
# a step) and hit no cap charges nothing; the new slot carries the run's figures on, with what the
# old one carried (`k`), for at most `carry_s` from the first (%(carry_since)s: the wall clock less
# that; %(carry)s false: never). Their CPU stays in the day's reserved CPU until the slot's end
# charges it as used (`charge`; the reclaim and an undone admission: `charge_day`), so
# used + reserved CPU is what it would be charged at once, and the cap exact. Then the pass-on
# writes none of the rows its account's other workers write too (its Budget, usage and Backlog rows).
CARRY_IF = ("EXISTS (SELECT 1 FROM h) AND %(carry)s AND %(cap_hits)s = 0 "
            "AND r.cpu_reserved_ms - %(cpu_ms)s <= %(step_ms)s "
            "AND COALESCE(r.carried_since, %(created_at)s) > %(carry_since)s")
_CARRIED_COLUMNS = ("carried_runs, carried_cpu_ms, carried_wall_ms, carried_db_wait_ms, carried_storage_wait_ms, "
                    "carried_since")
_CARRIED_ON = ("k.carry * (r.carried_runs + 1), k.carry * (r.carried_cpu_ms + %(cpu_ms)s), "
               "k.carry * (r.carried_wall_ms + %(wall_ms)s), k.carry * (r.carried_db_wait_ms + %(db_wait_ms)s), "
               "k.carry * (r.carried_storage_wait_ms + %(storage_wait_ms)s), "
               "CASE WHEN k.carry = 1 THEN COALESCE(r.carried_since, %(created_at)s::timestamptz) END")

# The settlement that passes its slot on, no lock: as SETTLE, and the first job of the account's
# line claimed (`h`, the kernel's claim, on PASS_ON_IF), its slot inserted ACTIVE with KEPT of the
# run's reservation and what it carries (`n`) and its run's record (`s`); `c` gives back only the
# rest, or, carrying (`k`), charges nothing. Slots taken and running, and used + reserved CPU, never
# grow (a slot goes, one comes; what is kept was reserved), so nothing it does can pass a cap an
# admission under the lock checked. Reads as SETTLE, plus the first unclaimed rows of the account's
# line (index deferred_line) and the queue's dispatched slots; carrying, the usage row's id by key.
# What SETTLE reads of the holding area after its charge (the settling worker's next step) it reads
# only when the slot was not passed on (`_unless_passed`: PostgreSQL runs a sub-select of a CASE
# branch not taken not at all), which is what a pass-on's caller then needs.
_CARRIES = "EXISTS (SELECT 1 FROM k WHERE carry = 1)"


def _unless_passed(question: str) -> str:
    return f"CASE WHEN n.id IS NULL THEN {question} ELSE FALSE END"


SETTLE_AND_PASS_ON = (
    f"WITH r AS ({DELETE_SLOT}), h AS ({claim(only_if=PASS_ON_IF)}), "
    f"k AS (SELECT CASE WHEN {CARRY_IF} THEN 1 ELSE 0 END AS carry FROM r), "
    f"c AS ({_charge_sql(kept=f'CASE WHEN EXISTS (SELECT 1 FROM h) THEN {KEPT} ELSE 0 END', unless=_CARRIES)}), "
    "t AS ({run_end}), s AS ({new_run}), "
    f"n AS (INSERT INTO {R} ({SLOT_COLUMNS}, {_CARRIED_COLUMNS}) SELECT %(account_id)s::bigint, %(queue)s::varchar, "
    f"r.day, h.job, h.ref, {ACTIVE}, %(slot_lease)s::timestamptz, %(created_at)s::timestamptz, %(worker)s::varchar, "
    f"{KEPT}, 0, 0, (SELECT id FROM s), {_CARRIED_ON} FROM h, r, k "
    "RETURNING job, ref, id, task_run_id, cpu_reserved_ms) "
    f"SELECT r.task_run_id, r.status, {_unless_passed(sql.in_line(account='%(account_id)s', queue='%(queue)s'))} AS in_line, "
    f"{_unless_passed(sql.any_ready())} AS waiting, {_unless_passed(others_ready())} AS others_waiting, "
    "n.job AS passed_job, n.ref AS passed_ref, n.id AS passed_slot_id, n.task_run_id AS passed_run_id, "
    "n.cpu_reserved_ms AS passed_reserved_ms, "
    f"COALESCE((SELECT id FROM c), (SELECT x.id FROM {U} x WHERE x.account_id = %(account_id)s AND x.queue = %(queue)s "
    "AND x.day = r.day)) AS usage_id, (SELECT priority FROM h) AS passed_priority "
    "FROM r LEFT JOIN n ON TRUE")


def charge(*, slot_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, end: RunEnd,
           now: dt.datetime, pass_on: PassOn | None = None) -> Charged | None:
    """ACTIVE (or DISPATCHED, RECLAIMED) -> (none): the settlement. Deletes the slot, charges the
    run's figures to its day (a reclaimed run only what the reclaim did not: its cpu_charged_ms) and
    records them on its run (`end`); None when it was settled already (exactly once). With
    `pass_on`, the slot goes on to the account's next held job when it may (SETTLE_AND_PASS_ON)."""
    run_end_sql, run_end_params = task_run_end_sql(run_id_sql=RUN_OF_R, end=end)
    params = db.params(run_end_params, {
        "slot_id": slot_id, "account_id": account_id, "queue": queue, "cpu_ms": meter.cpu_ms,
        "wall_ms": meter.wall_ms, "db_wait_ms": round(meter.db_wait_ms),
        "storage_wait_ms": round(meter.storage_wait_ms), "cap_hits": 1 if cap_hit else 0, "now": now})
    if pass_on is not None:
        return _charge_and_pass_on(params, run_end_sql, pass_on)
    row = db.fetch_one_named(compose(SETTLE, run_end=run_end_sql), params)
    if row is None:
        return None
    return Charged(row["task_run_id"], row["status"] == ReservationStatus.ACTIVE, in_line=row["in_line"],
                   waiting=row["waiting"], others_waiting=row["others_waiting"])


def _charge_and_pass_on(params: dict, run_end_sql: str, pass_on: PassOn) -> Charged | None:
    account_id, queue, now = params["account_id"], params["queue"], params["now"]
    step, carry_s = settings.FAIRSHARE["RESERVATION_STEP_MS"], settings.FAIRSHARE["CHARGE_CARRY_S"]
    run = TaskRun(account_id=account_id, queue=queue, worker=pass_on.worker)
    new_run_sql, new_run_params = task_run_insert_sql(run, source="h", taken={"job": "h.job", "ref": "h.ref"})
    wall_now = timezone.now()
    params = db.params(params, new_run_params, {
        "today": pass_on.day, "step_ms": step, "keep_at_least": max(1, step // 2), "worker": pass_on.worker,
        "claim_expires_at": now + dt.timedelta(seconds=pass_on.lease_s), **broker_window(),
        "slot_lease": wall_now + dt.timedelta(seconds=pass_on.lease_s), "created_at": wall_now,
        "carry": carry_s > 0, "carry_since": wall_now - dt.timedelta(seconds=carry_s)})
    row = db.fetch_one_named(compose(SETTLE_AND_PASS_ON, run_end=run_end_sql, new_run=new_run_sql), params)
    if row is None:
        return None
    passed = None
    if row["passed_job"] is not None:
        run.pk, run.job, run.ref = row["passed_run_id"], row["passed_job"], row["passed_ref"]
        passed = Claimed(Envelope(job=run.job, account=account_id, ref=run.ref, priority=row["passed_priority"]),
                         row["passed_slot_id"], run=run, reserved_ms=row["passed_reserved_ms"],
                         usage_id=row["usage_id"])
    return Charged(row["task_run_id"], row["status"] == ReservationStatus.ACTIVE, in_line=row["in_line"],
                   waiting=row["waiting"], others_waiting=row["others_waiting"], passed=passed)


NOTHING_CARRIED = {"carried_runs": 0, "carried_cpu_ms": 0, "carried_wall_ms": 0, "carried_db_wait_ms": 0,
                   "carried_storage_wait_ms": 0, "carried_since": None}


def charge_day(slot: Reservation, *, cpu_ms: int = 0, reserved_ms: int = 0, runs: int = 0) -> None:
    """Charge the slot's day these figures (`reserved_ms` given back), and what the slot carried of
    the runs it was passed on from (a pass-on's carried charges: their CPU moves from reserved to
    used). What ends a slot other than its settlement (a reclaim, an undone admission) charges it so."""
    UsageDay.objects.filter(account_id=slot.account_id, queue=slot.queue, day=slot.day).update(
        cpu_used_ms=F("cpu_used_ms") + cpu_ms + slot.carried_cpu_ms,
        cpu_reserved_ms=F("cpu_reserved_ms") - reserved_ms - slot.carried_cpu_ms,
        runs=F("runs") + runs + slot.carried_runs, wall_ms=F("wall_ms") + slot.carried_wall_ms,
        db_wait_ms=F("db_wait_ms") + slot.carried_db_wait_ms,
        storage_wait_ms=F("storage_wait_ms") + slot.carried_storage_wait_ms)
