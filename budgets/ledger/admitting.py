"""The transitions that admit a run: a slot made ACTIVE with CPU reserved and the run recorded as
started, from a job's own dispatched slot, a new one, or a held job claimed for a worker; and the
undoing of an admission whose run never started.

`admit_at_once` takes no lock and still cannot pass a cap: it proves by the account's Budget row's
version that no lock holder committed since its snapshot, and holds that row to its commit
(queries.sql `admit_at_once`). Everything else here runs under the account's lock
(budgets.locks), which read the standing it decides on.

Cost: rows by key (the account's Budget and usage row, the job's slot, its run), and for a claim
the first unclaimed rows of one account's line (index deferred_line).
"""
import datetime as dt

from django.utils import timezone

from budgets import standing
from budgets.ledger.reads import QUERIES, broker_window, usage_id
from budgets.ledger.values import AdmittedAtOnce, Claimed
from budgets.standing import Standing
from scheduling import clock, db
from scheduling.envelope import Envelope
from scheduling.models import TaskRun
from scheduling.services import task_run_start_params

# How many times `admit_at_once` tries when a lock holder committed since its statement's
# snapshot: again at once (a new snapshot sees that commit: the account's other worker admitting
# at the same moment, most of the time), then it leaves the job to the lock.
AT_ONCE_TRIES = 2


def admit_at_once(*, envelope: Envelope, queue: str, day: dt.date, reserve_ms: int, run: TaskRun,
                  worker: str) -> AdmittedAtOnce:
    """DISPATCHED (its own) -> ACTIVE without the lock, for a job sent with a slot of its own whose
    account is plainly below its caps; slot_id None when the lock must decide."""
    params = {**task_run_start_params(run), "account_id": envelope.account, "queue": queue, "job": envelope.job,
              "ref": envelope.ref, "day": day, "reserve_ms": reserve_ms, "worker": worker,
              "lease": standing.run_lease_expiry()}
    for _ in range(AT_ONCE_TRIES):
        row = db.fetch_one_named(QUERIES["admit_at_once"], params)
        if row["fresh"]:
            break  # decided (admitted or not); else a lock holder committed since its snapshot
    if row["slot_id"] is None:
        return AdmittedAtOnce(None)
    run.pk = row["task_run_id"]
    return AdmittedAtOnce(row["slot_id"], paused=row["paused"])


# `activate`'s run parameters when it inserts no run (its INSERT's one-time filter is false).
NO_RUN = {"run_account_id": None, "run_job": "", "run_queue": "", "run_ref": "", "run_worker": "",
          "run_started_at": None}


def activate(*, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None, reserve_ms: int,
             run: TaskRun | None, worker: str, claimant: str | None = None, lease_s: float | None = None) -> int:
    """DISPATCHED (its own, `own`) or (none) -> ACTIVE: reserve the run's CPU on its day, record the
    run as started (inserting a `run` not saved yet), and for a job claimed by `claimant` complete
    the claim. Its lease is a running slot's, or `lease_s` (admitted ahead with a claim: until it
    starts). Under the account's lock; returns the slot's id."""
    insert_run = run is not None and run.pk is None
    lease = standing.run_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
    row = db.fetch_one_named(QUERIES["activate"], {
        **(task_run_start_params(run) if insert_run else NO_RUN), "insert_run": insert_run,
        "claimed": claimant is not None, "usage_id": usage_id(state, account_id=envelope.account, queue=queue, day=day),
        "reserve_ms": reserve_ms, "own": own, "account_id": envelope.account, "queue": queue, "day": day,
        "job": envelope.job, "ref": envelope.ref, "worker": worker, "lease": lease, "created_at": timezone.now(),
        "run_id": run.pk if run is not None else None})
    if insert_run:
        run.pk = row["task_run_id"]
    return row["id"]


def _claim(*, account_id: int, queue: str, day: dt.date, worker: str, yield_to_broker: bool, admit: bool,
           usage: int | None = None, reserve_ms: int = 0) -> Claimed | None:
    """The `claim` statement: its claim's expiry on the kernel's clock (the holding area's), its
    slot's lease on the wall clock."""
    now, lease_s = clock.now(), standing.claim_lease_s()
    run = TaskRun(account_id=account_id, queue=queue, worker=worker)
    row = db.fetch_one_named(QUERIES["claim"], {
        "account_id": account_id, "queue": queue, "day": day, "worker": worker, "now": now,
        "claim_expires_at": now + dt.timedelta(seconds=lease_s), **broker_window(), "yield_to_broker": yield_to_broker,
        "slot_lease": timezone.now() + dt.timedelta(seconds=lease_s), "created_at": timezone.now(), "admit": admit,
        "usage_id": usage, "reserve_ms": reserve_ms, "run_started_at": task_run_start_params(run)["run_started_at"]})
    if row is None:
        return None
    envelope = Envelope(job=row["job"], account=account_id, ref=row["ref"], priority=row["priority"])
    if not admit:
        return Claimed(envelope, row["id"])
    run.pk, run.job, run.ref = row["task_run_id"], row["job"], row["ref"]
    return Claimed(envelope, row["id"], run=run, reserved_ms=reserve_ms, usage_id=usage)


def claim_for(*, account_id: int, queue: str, day: dt.date, worker: str, yield_to_broker: bool) -> Claimed | None:
    """(a held job) -> DISPATCHED on the claim's lease: claim the first job of the account's line for
    `worker` and take its slot, unless (`yield_to_broker`) a job sent to the broker waits. Under the
    account's lock."""
    return _claim(account_id=account_id, queue=queue, day=day, worker=worker, yield_to_broker=yield_to_broker,
                  admit=False)


def claim_and_admit(*, account_id: int, queue: str, state: Standing, day: dt.date, worker: str, reserve_ms: int,
                    yield_to_broker: bool) -> Claimed | None:
    """(a held job) -> ACTIVE on the claim's lease: `claim_for`, and the job admitted ahead in the
    same statement: `reserve_ms` reserved, its run recorded. Under the account's lock, which saw the
    standing let it in."""
    return _claim(account_id=account_id, queue=queue, day=day, worker=worker, yield_to_broker=yield_to_broker,
                  admit=True, usage=usage_id(state, account_id=account_id, queue=queue, day=day),
                  reserve_ms=reserve_ms)


def start_admitted(*, slot_id: int, envelope: Envelope, worker: str) -> bool:
    """ACTIVE on a claim's lease -> ACTIVE (running): the job admitted ahead starts; its claim
    completes, if its slot is still there (locked, not written: the claim's lease runs until the
    run's watcher renews it, well before it ends: budgets.watcher). False when either is gone (the
    slot reclaimed, or the job held again, which voids a claim): it must not run."""
    return db.fetch_one(QUERIES["start_admitted"], {"slot_id": slot_id, "job": envelope.job, "ref": envelope.ref,
                                                    "worker": worker}) is not None


def unadmit(*, slot_id: int, account_id: int, queue: str, expired_before: dt.datetime | None = None) -> int | None:
    """ACTIVE on a claim's lease -> (none): an admission whose run never started is undone, its CPU
    unreserved, nothing charged or counted; with `expired_before`, only if its lease is still
    expired then; what the slot carried of the runs it was passed on from is charged. Returns its
    run's id (None when nothing was undone). (`account_id`, `queue`: the slot's, as its row says.)"""
    row = db.fetch_one(QUERIES["unadmit"], {"slot_id": slot_id, "expired_before": expired_before})
    return None if row is None else row[0]


def reserve_more(*, slot_id: int, usage_id: int, ms: int) -> None:
    """ACTIVE on a claim's lease -> the same: `ms` more reserved for a job admitted ahead whose
    estimate is larger than a step; under the lock, which saw the account has it."""
    db.fetch_one(QUERIES["reserve_more"], {"slot_id": slot_id, "usage_id": usage_id, "ms": ms, "checked": True})


def reserve_if_left(*, slot_id: int, usage_id: int, ms: int) -> bool:
    """`ms` more for a slot admitted ahead (a pass-on's job that estimates more than it kept), when
    its account has that much left (checked on the usage row's latest version: two of these never
    reserve the same budget twice); no lock."""
    return db.fetch_one(QUERIES["reserve_more"], {"slot_id": slot_id, "usage_id": usage_id, "ms": ms,
                                                  "checked": False}) is not None
