"""The settlement: ACTIVE (or DISPATCHED, RECLAIMED) -> (none), one statement without the lock
(queries.sql `settle`): it only frees, and a slot it frees is never missed by a job being put on
hold at the same moment, because both sides look again once they committed and one of them sees the
other (budgets.admission.wake_when_committed, the watcher's look). Its pass-on of the slot to the
account's next held job swaps one slot and its reservation for another (or carries the run's charge
on), so slots taken and running, and used + reserved CPU, stay as they were.
"""
import datetime as dt

from django.conf import settings
from django.utils import timezone

from budgets.ledger.reads import QUERIES, broker_window
from budgets.ledger.values import Charged, Claimed, PassOn
from budgets.models import ReservationStatus
from scheduling import db
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.services import RunEnd, task_run_start_params

# What a settlement that does not pass its slot on gives for the pass-on's parameters.
NO_PASS_ON = PassOn(worker="", day=dt.date.min, lease_s=0)


def charge(*, slot_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, end: RunEnd,
           now: dt.datetime, pass_on: PassOn | None = None) -> Charged | None:
    """ACTIVE (or DISPATCHED, RECLAIMED) -> (none): the slot deleted, the run's figures charged to
    its day and recorded on its run (`end`); None when it was settled already (exactly once). With
    `pass_on`, the slot goes on to the account's next held job when it may."""
    step, carry_s = settings.FAIRSHARE["RESERVATION_STEP_MS"], settings.FAIRSHARE["CHARGE_CARRY_S"]
    passing = pass_on or NO_PASS_ON
    run = TaskRun(account_id=account_id, queue=queue, worker=passing.worker)
    wall_now = timezone.now()
    row = db.fetch_one(QUERIES["settle"], {
        **end.params(), "slot_id": slot_id, "account_id": account_id, "queue": queue, "cpu_ms": meter.cpu_ms,
        "wall_ms": meter.wall_ms, "db_wait_ms": round(meter.db_wait_ms), "storage_wait_ms": round(meter.storage_wait_ms),
        "cap_hits": 1 if cap_hit else 0, "now": now, "pass_on": pass_on is not None, "today": passing.day,
        "step_ms": step, "keep_at_least": max(1, step // 2), "worker": passing.worker,
        "claim_expires_at": now + dt.timedelta(seconds=passing.lease_s), **broker_window(),
        "slot_lease": wall_now + dt.timedelta(seconds=passing.lease_s), "created_at": wall_now,
        "carry": carry_s > 0, "carry_since": wall_now - dt.timedelta(seconds=carry_s),
        "run_started_at": task_run_start_params(run)["run_started_at"]})
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
