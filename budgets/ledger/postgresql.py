"""The PostgreSQL ledger: the portable ledger's transitions, those on a task's path in one statement
each (budgets/ledger/statements.py, settling.py), prepared once per connection (scheduling.db.cursor).

Three of them take no lock and still cannot pass a cap:
- `charge` only frees (a slot, a reservation): a slot it frees is never missed by a job being put
  on hold at the same moment, because both sides look again once they committed and one of them
  sees the other (budgets.admission.wake_when_committed, the worker's watcher's look);
- its pass-on swaps one slot and its reservation for another: slots taken and running, and used +
  reserved CPU, stay as they were;
- `admit_at_once` proves by the Budget row's version that no lock holder committed since its
  snapshot, and holds that row to its commit.
Each transition's docstring is the portable ledger's; this module says only how it does it here.
"""
import datetime as dt
import functools

from django.conf import settings
from django.utils import timezone

from budgets import standing
from budgets.ledger import AdmittedAtOnce, Charged, Claimed, PassOn, portable
from budgets.ledger import settling
from budgets.ledger import statements as s
from budgets.ledger.order import Ready, broker_window
from budgets.models import Queue, ReservationStatus
from budgets.standing import Standing
from scheduling import clock, db, sql
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.services import RunEnd, task_run_end_sql, task_run_insert_sql

# How many times `admit_at_once` tries when a lock holder committed since its statement's
# snapshot: again at once (a new snapshot sees that commit: the account's other worker admitting
# at the same moment, most of the time), then it leaves the job to the lock.
AT_ONCE_TRIES = 2


@functools.cache
def _composed(template: str, **parts: str) -> str:
    """A statement of this module: a template of budgets.ledger's with the kernel's SQL for its
    parts (a run's insert and end, a claim), composed once per shape and then the same string
    object, whose hash and conversion the cursor keeps (the pass-on's is 8 KB, sent for each task)."""
    return template.format(**parts)


def _one(statement: str, params: dict) -> tuple | None:
    with db.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.fetchone()


def _broker_window() -> dict[str, dt.datetime]:
    forgets, since = broker_window()
    return {"broker_since": since, "broker_forgets": forgets}


class Ledger(portable.Ledger):
    def lock(self, *, account_id: int, queue: str) -> bool:
        return _one(s.LOCK, {"account_id": account_id, "queue": queue}) is not None

    def standing(self, *, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None,
                 claimant: str | None = None) -> Standing | None:
        job, ref = (envelope.job, envelope.ref) if envelope is not None else ("", "")
        row = _one(s.STANDING, {"account_id": account_id, "queue": queue, "day": day, "job": job, "ref": ref,
                                "claimant": claimant, "now": clock.now(), "wall_now": timezone.now()})
        if row is None:
            return None
        cpu_seconds, max_concurrent, usage_id, used, reserved, in_flight, active, in_line, blocked, own, paused, \
            claimed, weight, rate_starts, rate_period_s, recent_starts, rate_frees_at = row
        return Standing(cpu_limit_ms=cpu_seconds * 1000, max_concurrent=max_concurrent, usage_id=usage_id,
                        cpu_used_ms=used, cpu_reserved_ms=reserved, in_flight=in_flight, active=active,
                        in_line=in_line, blocked=blocked, own_slot=own, paused=paused, claimed=claimed,
                        weight=weight, rate_starts=rate_starts, rate_period_s=rate_period_s,
                        recent_starts=recent_starts, rate_frees_at=clock.from_wall(rate_frees_at))

    def ready_accounts(self, *, queue: str | None, limit: int | None = None) -> list[Ready]:
        if queue is None:
            return [pair for q in _queues() for pair in self.ready_accounts(queue=q, limit=limit)]
        with db.cursor() as cursor:
            cursor.execute(s.READY_ACCOUNTS, {"queue": queue, "limit": limit})
            return [Ready(account_id, queue, share) for account_id, share in cursor.fetchall()]

    def broker_waiting(self, *, queue: str) -> bool:
        return _one(s.BROKER_WAITING, {"queue": queue, **_broker_window()})[0]

    def dispatch_or_hold(self, *, envelope: Envelope, queue: str, day: dt.date) -> bool | None:
        row = _one(s.DISPATCH_OR_HOLD, {
            "account_id": envelope.account, "queue": queue, "day": day, "job": envelope.job, "ref": envelope.ref,
            "priority": envelope.priority, "lease": standing.dispatch_lease_expiry(), "created_at": timezone.now(),
            "now": clock.now(), **_broker_window()})
        return None if row is None else row[0] is not None

    def admit_at_once(self, *, envelope: Envelope, queue: str, day: dt.date, reserve_ms: int, run: TaskRun,
                      worker: str) -> AdmittedAtOnce:
        run_sql, run_params = task_run_insert_sql(run, source="u")
        statement = _composed(s.ADMIT_AT_ONCE, run=run_sql)
        params = db.params(run_params, {
            "account_id": envelope.account, "queue": queue, "job": envelope.job, "ref": envelope.ref, "day": day,
            "reserve_ms": reserve_ms, "worker": worker, "lease": standing.run_lease_expiry()})
        for _ in range(AT_ONCE_TRIES):
            fresh, slot_id, run_id, paused = _one(statement, params)
            if fresh:
                break  # decided (admitted or not); else a lock holder committed since its snapshot
        if slot_id is None:
            return AdmittedAtOnce(None)
        run.pk = run_id
        return AdmittedAtOnce(slot_id, paused=paused)

    def activate(self, *, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None,
                 reserve_ms: int, run: TaskRun | None, worker: str, claimant: str | None = None,
                 lease_s: float | None = None) -> int:
        insert_run = run is not None and run.pk is None
        run_sql, run_params = task_run_insert_sql(run) if insert_run else ("", {})
        parts = [f"u AS ({s.RESERVE} RETURNING 1)"] + ([f"t AS ({run_sql})"] if insert_run else [])
        if claimant is not None:
            parts.append(f"k AS ({sql.complete_claim()})")
        slot_sql = (s.ACTIVATE_OWN if own is not None else s.ACTIVATE_NEW).format(
            run_id="(SELECT id FROM t)" if insert_run else "%(run_id)s")
        lease = standing.run_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
        params = db.params(run_params, {
            "usage_id": self.usage_id(state, account_id=envelope.account, queue=queue, day=day),
            "reserve_ms": reserve_ms, "own": own, "account_id": envelope.account, "queue": queue, "day": day,
            "job": envelope.job, "ref": envelope.ref, "worker": worker, "lease": lease, "created_at": timezone.now(),
            "run_id": run.pk if run is not None else None})
        slot_id, run_id = _one(f"WITH {', '.join(parts)} {slot_sql}", params)
        if insert_run:
            run.pk = run_id
        return slot_id

    def charge(self, *, slot_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, end: RunEnd,
               now: dt.datetime, pass_on: PassOn | None = None) -> Charged | None:
        run_end_sql, run_end_params = task_run_end_sql(run_id_sql=settling.RUN_OF_R, end=end)
        params = db.params(run_end_params, {
            "slot_id": slot_id, "account_id": account_id, "queue": queue, "cpu_ms": meter.cpu_ms,
            "wall_ms": meter.wall_ms, "db_wait_ms": round(meter.db_wait_ms),
            "storage_wait_ms": round(meter.storage_wait_ms), "cap_hits": 1 if cap_hit else 0, "now": now})
        if pass_on is not None:
            return self._charge_and_pass_on(params, run_end_sql, pass_on)
        row = _one(_composed(settling.SETTLE, run_end=run_end_sql), params)
        if row is None:
            return None
        task_run_id, status, in_line, waiting, others_waiting = row
        return Charged(task_run_id, status == ReservationStatus.ACTIVE, in_line=in_line, waiting=waiting,
                       others_waiting=others_waiting)

    def _charge_and_pass_on(self, params: dict, run_end_sql: str, pass_on: PassOn) -> Charged | None:
        account_id, queue, now = params["account_id"], params["queue"], params["now"]
        step, carry_s = settings.FAIRSHARE["RESERVATION_STEP_MS"], settings.FAIRSHARE["CHARGE_CARRY_S"]
        run = TaskRun(account_id=account_id, queue=queue, worker=pass_on.worker)
        new_run_sql, new_run_params = task_run_insert_sql(run, source="h", taken={"job": "h.job", "ref": "h.ref"})
        wall_now = timezone.now()
        params = db.params(params, new_run_params, {
            "today": pass_on.day, "step_ms": step, "keep_at_least": max(1, step // 2), "worker": pass_on.worker,
            "claim_expires_at": now + dt.timedelta(seconds=pass_on.lease_s), **_broker_window(),
            "slot_lease": wall_now + dt.timedelta(seconds=pass_on.lease_s), "created_at": wall_now,
            "carry": carry_s > 0, "carry_since": wall_now - dt.timedelta(seconds=carry_s)})
        row = _one(_composed(settling.SETTLE_AND_PASS_ON, run_end=run_end_sql, new_run=new_run_sql), params)
        if row is None:
            return None
        task_run_id, status, in_line, waiting, others_waiting, job, ref, slot_id, run.pk, reserved_ms, usage_id, \
            priority = row
        passed = None
        if job is not None:
            run.job, run.ref = job, ref
            passed = Claimed(Envelope(job=job, account=account_id, ref=ref, priority=priority), slot_id, run=run,
                             reserved_ms=reserved_ms, usage_id=usage_id)
        return Charged(task_run_id, status == ReservationStatus.ACTIVE, in_line=in_line, waiting=waiting,
                       others_waiting=others_waiting, passed=passed)

    def _claim_params(self, *, account_id: int, queue: str, day: dt.date, worker: str) -> dict:
        """A claim's: its expiry on the kernel's clock (the holding area's), its slot's lease on the wall clock."""
        now, lease_s = clock.now(), standing.claim_lease_s()
        return {"account_id": account_id, "queue": queue, "day": day, "worker": worker, "now": now,
                "claim_expires_at": now + dt.timedelta(seconds=lease_s), **_broker_window(),
                "slot_lease": timezone.now() + dt.timedelta(seconds=lease_s), "created_at": timezone.now()}

    def claim_for(self, *, account_id: int, queue: str, day: dt.date, worker: str,
                  yield_to_broker: bool) -> Claimed | None:
        claim = _CLAIM_YIELDING if yield_to_broker else _CLAIM
        row = _one(_composed(s.CLAIM_FOR, claim=claim),
                   self._claim_params(account_id=account_id, queue=queue, day=day, worker=worker))
        if row is None:
            return None
        job, ref, slot_id, priority = row
        return Claimed(Envelope(job=job, account=account_id, ref=ref, priority=priority), slot_id)

    def claim_and_admit(self, *, account_id: int, queue: str, state: Standing, day: dt.date, worker: str,
                        reserve_ms: int, yield_to_broker: bool) -> Claimed | None:
        claim = _CLAIM_YIELDING if yield_to_broker else _CLAIM
        run = TaskRun(account_id=account_id, queue=queue, worker=worker)
        new_run_sql, new_run_params = task_run_insert_sql(run, source="c", taken={"job": "c.job", "ref": "c.ref"})
        usage_id = self.usage_id(state, account_id=account_id, queue=queue, day=day)
        params = db.params(new_run_params, self._claim_params(account_id=account_id, queue=queue, day=day, worker=worker),
                           {"usage_id": usage_id, "reserve_ms": reserve_ms})
        row = _one(_composed(s.CLAIM_AND_ADMIT, claim=claim, new_run=new_run_sql), params)
        if row is None:
            return None
        job, ref, slot_id, run.pk, priority = row
        run.job, run.ref = job, ref
        return Claimed(Envelope(job=job, account=account_id, ref=ref, priority=priority), slot_id, run=run,
                       reserved_ms=reserve_ms, usage_id=usage_id)

    def start_admitted(self, *, slot_id: int, envelope: Envelope, worker: str) -> bool:
        return _one(s.START_ADMITTED, {"slot_id": slot_id, "job": envelope.job, "ref": envelope.ref,
                                       "worker": worker}) is not None

    def reserve_if_left(self, *, slot_id: int, usage_id: int, ms: int) -> bool:
        return _one(s.RESERVE_IF_LEFT, {"slot_id": slot_id, "usage_id": usage_id, "ms": ms}) is not None


# A hand-off's claim, and the same unless a job sent to the broker waits for a worker.
_CLAIM, _CLAIM_YIELDING = s.claim(), s.claim(only_if=f"NOT {s.broker_waiting()}")


def _queues() -> list[str]:
    return list(Queue.values)
