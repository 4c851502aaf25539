"""Admission: a slot for a job on its way to the broker ((none) -> DISPATCHED, and back), or to run
(ACTIVE: CPU reserved, its run recorded), and an admission undone. Under the account's lock
(budgets.locks) but `dispatch_or_hold` and `admit_at_once` (queries.sql says why they are safe).
"""
import datetime as dt
import json
from typing import Any

from django.utils import timezone

from budgets import standing
from budgets.ledger.reads import QUERIES, broker_window, usage_id
from budgets.ledger.values import AdmittedAtOnce, Claimed, EnqueueCheck
from budgets.models import Reservation, ReservationStatus
from budgets.standing import Standing
from scheduling import clock, db
from scheduling.envelope import Envelope
from scheduling.liveness import heard_since
from scheduling.models import DeferredTask, TaskRun
from scheduling.services import task_run_start_params

# How many times `admit_at_once` tries when a lock holder committed since its snapshot (a new
# snapshot sees that commit: most often the account's other worker admitting at the same moment).
AT_ONCE_TRIES = 2


def dispatch_or_hold(*, envelope: Envelope, queue: str, day: dt.date) -> EnqueueCheck:
    """(none) -> DISPATCHED or held without the lock, or neither: the lock must decide."""
    row = db.fetch_one(QUERIES["dispatch_or_hold"], {"live_since": heard_since(),
        "account_id": envelope.account, "queue": queue, "day": day, "job": envelope.job, "ref": envelope.ref,
        "priority": envelope.priority, "lease": standing.dispatch_lease_expiry(), "created_at": timezone.now(),
        "now": clock.now(), **broker_window()})
    return EnqueueCheck(row["decided"], row["slot_id"], row["workers_free"])


def dispatch_many(*, envelopes: list[Envelope], queue: str, day: dt.date) -> list[int]:
    """(none) -> DISPATCHED: a slot for each job sent; their ids."""
    expires = standing.dispatch_lease_expiry()
    return [slot.pk for slot in Reservation.objects.bulk_create([
        Reservation(account_id=e.account, queue=queue, day=day, job=e.job, ref=e.ref,
                    status=ReservationStatus.DISPATCHED, lease_expires_at=expires) for e in envelopes])]


def dispatch(*, envelope: Envelope, queue: str, day: dt.date) -> int:
    """`dispatch_many` for one job."""
    (slot_id,) = dispatch_many(envelopes=[envelope], queue=queue, day=day)
    return slot_id


def release(*, account_id: int, queue: str, day: dt.date, limit: int) -> list[DeferredTask]:
    """(held jobs) -> DISPATCHED: the line's first `limit` claimable jobs out of the holding area,
    each with a slot, under the lock; to send once the caller commits (scheduling.holding)."""
    rows = db.fetch_all(QUERIES["release"], {
        "account_id": account_id, "queue": queue, "day": day, "limit": limit, "now": clock.now(),
        "lease": standing.dispatch_lease_expiry(), "created_at": timezone.now()})
    return [DeferredTask(account_id=account_id, queue=queue, job=row["job"], ref=row["ref"], priority=row["priority"],
                         message=None if row["message"] is None else json.loads(row["message"])) for row in rows]


def redispatch(*, slot_id: int) -> None:
    """DISPATCHED -> DISPATCHED: a reconciler's re-send, with a new dispatch lease."""
    Reservation.objects.filter(pk=slot_id).update(lease_expires_at=standing.dispatch_lease_expiry())


def drop(*, slot_id: int) -> None:
    """DISPATCHED -> (none): a sent job held again gives its slot back."""
    Reservation.objects.filter(pk=slot_id, status=ReservationStatus.DISPATCHED).delete()


def undispatch(*, envelope: Envelope, queue: str) -> None:
    """DISPATCHED -> (none): the job could not be sent after all (the broker refused it)."""
    dispatched = Reservation.objects.filter(account_id=envelope.account, queue=queue, job=envelope.job,
                                            ref=envelope.ref, status=ReservationStatus.DISPATCHED)
    Reservation.objects.filter(pk=dispatched.order_by("-pk").values_list("pk", flat=True).first()).delete()


def admit_at_once(*, envelope: Envelope, queue: str, day: dt.date, reserve_ms: int, run: TaskRun,
                  worker: str) -> AdmittedAtOnce:
    """DISPATCHED (its own) -> ACTIVE without the lock; slot_id None when the lock must decide."""
    params = {**task_run_start_params(run), "account_id": envelope.account, "queue": queue, "job": envelope.job,
              "ref": envelope.ref, "day": day, "reserve_ms": reserve_ms, "worker": worker,
              "lease": standing.run_lease_expiry()}
    for _ in range(AT_ONCE_TRIES):
        row = db.fetch_one(QUERIES["admit_at_once"], params)
        if row["fresh"]:
            break  # decided (admitted or not); else a lock holder committed since its snapshot
    if row["slot_id"] is None:
        return AdmittedAtOnce(None)
    run.pk = row["task_run_id"]
    return AdmittedAtOnce(row["slot_id"], paused=row["paused"])


def activate(*, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None, reserve_ms: int,
             run: TaskRun | None, worker: str) -> int:
    """DISPATCHED (its own, `own`) or (none) -> ACTIVE, inserting a `run` not saved yet. Returns its id."""
    insert_run = run is not None and run.pk is None
    row = db.fetch_one(QUERIES["activate"], {
        **task_run_start_params(run if insert_run else TaskRun()), "insert_run": insert_run,
        "usage_id": usage_id(state, account_id=envelope.account, queue=queue, day=day),
        "reserve_ms": reserve_ms, "own": own, "account_id": envelope.account, "queue": queue, "day": day,
        "job": envelope.job, "ref": envelope.ref, "worker": worker, "lease": standing.run_lease_expiry(),
        "created_at": timezone.now(),
        "run_id": run.pk if run is not None else None})
    if insert_run:
        run.pk = row["task_run_id"]
    return row["id"]


def claim_params(*, run: TaskRun, now: dt.datetime, lease_s: float) -> dict[str, Any]:
    """A claim's parameters (queries.sql `claim`, `settle`'s pass-on) for `run`'s worker: its
    expiry on the kernel's clock (the holding area's), its slot's lease on the wall clock."""
    wall_now = timezone.now()
    return {"worker": run.worker, "now": now, "claim_expires_at": now + dt.timedelta(seconds=lease_s),
            "slot_lease": wall_now + dt.timedelta(seconds=lease_s), "created_at": wall_now, **broker_window(),
            "run_started_at": task_run_start_params(run)["run_started_at"]}


def claim_for(*, account_id: int, queue: str, day: dt.date, worker: str, yield_to_broker: bool, usage: int,
              reserve_ms: int) -> Claimed | None:
    """(a held job) -> ACTIVE on the claim's lease (admitted ahead, `reserve_ms` reserved on the usage
    row `usage`): the account's first held job claimed for `worker`, unless (`yield_to_broker`) the
    broker's job waits. Under the lock, which saw the standing let it start."""
    run = TaskRun(account_id=account_id, queue=queue, worker=worker)
    row = db.fetch_one(QUERIES["claim"], {
        **claim_params(run=run, now=clock.now(), lease_s=standing.claim_lease_s()), "account_id": account_id,
        "queue": queue, "day": day, "yield_to_broker": yield_to_broker, "usage_id": usage, "reserve_ms": reserve_ms})
    if row is None:
        return None
    run.pk, run.job, run.ref = row["task_run_id"], row["job"], row["ref"]
    envelope = Envelope(job=row["job"], account=account_id, ref=row["ref"], priority=row["priority"])
    return Claimed(envelope, row["id"], run=run, reserved_ms=reserve_ms, usage_id=usage)


def start_admitted(*, slot_id: int, envelope: Envelope, worker: str) -> bool:
    """ACTIVE on a claim's lease -> ACTIVE (running); False when its slot or claim is gone: no run."""
    return db.fetch_one(QUERIES["start_admitted"], {"slot_id": slot_id, "job": envelope.job, "ref": envelope.ref,
                                                    "worker": worker}) is not None


def unadmit(*, slot_id: int, account_id: int, queue: str, expired_before: dt.datetime | None = None) -> int | None:
    """ACTIVE on a claim's lease -> (none), never started (with `expired_before`: if its lease is
    still expired then). Returns its run's id, None when nothing was undone."""
    row = db.fetch_one(QUERIES["unadmit"], {"slot_id": slot_id, "expired_before": expired_before})
    return None if row is None else row["task_run_id"]


def reserve_more(*, slot_id: int, usage_id: int, ms: int, checked: bool) -> bool:
    """ACTIVE on a claim's lease -> the same, `ms` more reserved: `checked` under the lock, else only
    if its account has that much left."""
    return db.fetch_one(QUERIES["reserve_more"], {"slot_id": slot_id, "usage_id": usage_id, "ms": ms,
                                                  "checked": checked}) is not None
