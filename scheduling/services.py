"""Writes of the scheduling app: task runs and maintenance. (The holding area: scheduling.holding.)"""
import datetime as dt
import os
import socket
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import Coalesce, Now, TruncDate
from django.utils import timezone

from budgets.models import Account
from scheduling.metering import Meter
from scheduling.models import Outcome, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.redaction import describe_error, redact


_worker_id: list = [None, ""]  # [the pid it was made in, "host:pid"]


def worker_id() -> str:
    """This process's name for what it claims and runs ("host:pid"), made once per process: the
    pid is read again each time (django-q2 forks worker processes after this module may have been
    imported), the host name (a system call) only when the pid changed. Called several times per task."""
    pid = os.getpid()
    if _worker_id[0] != pid:
        _worker_id[:] = [pid, f"{socket.gethostname()}:{pid}"]
    return _worker_id[1]


def task_run_new(*, job: str, queue: str, account_id: int | None, ref: str) -> TaskRun:
    """A run's record, not saved yet: `task_run_mark_started` inserts it (in the transaction of the
    middleware that admits the run), else `task_run_finish` does, with how it ended."""
    return TaskRun(job=job, queue=queue, account_id=account_id, ref=ref, worker=worker_id(), started_at=timezone.now())


def task_run_start(*, job: str, queue: str, account_id: int | None, ref: str) -> TaskRun:
    run = task_run_new(job=job, queue=queue, account_id=account_id, ref=ref)
    run.save(force_insert=True)
    return run


def task_run_finish(
    *, run: TaskRun, outcome: str, meter: Meter, items: int, error: BaseException | None = None,
) -> None:
    error_class, error_message = describe_error(error) if error is not None else ("", "")
    figures = {"items": items, "error_class": error_class, "error_message": error_message, **_figures(meter)}
    # Settlement already recorded when an admitted run gave its slot back; keep that.
    if run.pk is not None and TaskRun.objects.filter(pk=run.pk).update(
            outcome=outcome, finished_at=Coalesce("finished_at", Now()), **figures):
        return
    # Never inserted (an account's run that was not admitted), or its insert was rolled back with
    # the admission that made it: recorded now, in one statement.
    run.pk = None
    for name, value in {"outcome": outcome, "finished_at": timezone.now(), **figures}.items():
        setattr(run, name, value)
    run.save(force_insert=True)


def final_outcome(outcome: str | None, error: BaseException | None) -> str:
    """How a run ended, from what the chain set (`TaskContext.outcome`) and the failure it saw: a
    failure classified for retry stays "retrying"; any other failure is "failed"."""
    if error is None:
        return outcome or Outcome.SUCCEEDED
    return Outcome.RETRYING if outcome == Outcome.RETRYING else Outcome.FAILED


def _figures(meter: Meter) -> dict[str, int]:
    return {"cpu_ms": meter.cpu_ms, "wall_ms": meter.wall_ms, "db_wait_ms": round(meter.db_wait_ms),
            "storage_wait_ms": round(meter.storage_wait_ms), "peak_rss_kb": meter.peak_rss_kb}


def task_run_reject(*, message: object, error: BaseException) -> TaskRun:
    """Record a message that broke the contract, so it is inspectable rather than dropped."""
    job = message.get("job") if isinstance(message, dict) else None
    account = message.get("account") if isinstance(message, dict) else None
    ref = message.get("ref") if isinstance(message, dict) else None
    error_class, error_message = describe_error(error)
    now = timezone.now()
    return TaskRun.objects.create(
        job=redact(str(job))[:100] if job is not None else "(malformed)",
        account_id=account if isinstance(account, int) and not isinstance(account, bool) and _account_exists(account) else None,
        ref=redact(str(ref))[:64] if ref is not None else "",
        worker=worker_id(), started_at=now, finished_at=now, outcome=Outcome.REJECTED,
        error_class=error_class, error_message=error_message,
    )


def _account_exists(account_id: int) -> bool:
    return Account.objects.filter(pk=account_id).exists()


# Transitions a middleware may need while a run holds or gives back a slot. Each is one UPDATE and
# joins the caller's transaction, so it commits (or not) with the caller's own bookkeeping.

def task_run_mark_started(*, run: TaskRun) -> int:
    """The run really starts now (it waited for a slot): its recorded time begins here. A run not
    saved yet (`task_run_new`) is inserted now, in one statement. Returns its id."""
    run.started_at = timezone.now()
    if run.pk is None:
        run.save(force_insert=True)
    else:
        TaskRun.objects.filter(pk=run.pk).update(started_at=run.started_at)
    return run.pk


# A run's start and end as parameters, for a caller that writes them in its own statement (budgets'
# ledger: its admission and settlement, a round trip less for each; its statements list TaskRun's
# columns, which tests/budgets/test_transitions.py checks against the model).

def task_run_start_params(run: TaskRun) -> dict[str, Any]:
    """`task_run_mark_started` for a run not saved yet, as a statement's parameters `run_<field>`
    (the caller sets `run.pk` from what its INSERT returns)."""
    run.started_at = timezone.now()
    return {"run_account_id": run.account_id, "run_job": run.job, "run_queue": run.queue, "run_ref": run.ref,
            "run_worker": run.worker, "run_started_at": run.started_at}


@dataclass(frozen=True)
class RunEnd:
    """How a run ended, as far as the middleware that frees its slot records it in its own write
    (budgets' settlement): its metered figures and, when the chain knows it, its outcome. Recorded
    with the settlement that charges them, so what the ledger was charged is what the run records
    even if the worker dies straight after; without an outcome, `task_run_finish` (which keeps
    this end time) adds it."""

    meter: Meter
    outcome: str | None = None
    items: int = 0
    error: BaseException | None = None

    def values(self) -> dict[str, Any]:
        values = {"finished_at": timezone.now(), **_figures(self.meter)}
        if self.outcome is not None:
            error_class, error_message = describe_error(self.error) if self.error is not None else ("", "")
            values.update(outcome=self.outcome, items=self.items, error_class=error_class, error_message=error_message)
        return values

    def params(self) -> dict[str, Any]:
        """`values` as a statement's parameters, each one given (None: not known yet, kept as it is)."""
        return {"outcome": None, "items": None, "error_class": None, "error_message": None, **self.values()}


def task_run_end(*, run_id: int, end: RunEnd) -> None:
    """Record how the run ended (`RunEnd`), in the caller's transaction."""
    TaskRun.objects.filter(pk=run_id).update(**end.values())


def task_run_recorded(run: TaskRun, *, outcome: str | None) -> None:
    """The caller's write recorded the run's end (`task_run_end`, or its `RunEnd.params` in the caller's statement) and committed:
    with an outcome the record is complete, and the run recording writes nothing more."""
    if outcome is not None:
        run.outcome = outcome


def task_run_amend_outcome(*, run: TaskRun, outcome: str) -> None:
    """A run recorded as ended (`task_run_recorded`) ended otherwise after all: the middleware that
    recorded it did so in the same transaction as its handler's last write, whose verdict it did
    not know yet (tasks.execution.CallMiddleware)."""
    TaskRun.objects.filter(pk=run.pk).update(outcome=outcome)
    run.outcome = outcome


def task_run_mark_lost(*, run_id: int, cpu_ms: int, reason: str) -> bool:
    """A run still recorded as running whose worker is gone: lost, with the CPU it had reported."""
    return TaskRun.objects.filter(pk=run_id, outcome=Outcome.RUNNING).update(
        outcome=Outcome.LOST, cpu_ms=cpu_ms, finished_at=Now(), error_class="WorkerLost", error_message=reason,
    ) == 1


def task_run_mark_not_started(*, run_id: int, reason: str) -> bool:
    """A run admitted ahead for a handed-off job whose worker died before it started: skipped."""
    return TaskRun.objects.filter(pk=run_id, outcome=Outcome.RUNNING).update(
        outcome=Outcome.SKIPPED, finished_at=Now(), error_class="WorkerLost", error_message=reason,
    ) == 1


def task_runs_sweep_lost() -> int:
    """Mark `lost` the runs still recorded as running whose worker has not been heard from for
    FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"], where nothing else will: runs that had settled (their
    figures are recorded) when the worker died before recording the outcome, and runs of jobs
    without an account, which hold no lease. An account's unsettled run is left to the reclaim
    of its lease, which also charges it. Returns how many runs it marked."""
    since = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
    alive = WorkerHeartbeat.objects.filter(seen_at__gte=since).values("worker")
    return TaskRun.objects.filter(
        Q(finished_at__isnull=False) | Q(account__isnull=True), outcome=Outcome.RUNNING, started_at__lt=since,
    ).exclude(worker__in=alive).update(
        outcome=Outcome.LOST, finished_at=Coalesce("finished_at", Now()), error_class="WorkerLost",
        error_message="the worker stopped before it recorded how the run ended",
    )


def retries_so_far(*, job: str, ref: str) -> int:
    """How many runs of this job and ref already failed transiently and were scheduled again,
    since it last failed for good or was cancelled: an operator's retry starts a fresh series."""
    runs = TaskRun.objects.filter(job=job, ref=ref)
    retrying = runs.filter(outcome=Outcome.RETRYING)
    ended = runs.filter(outcome__in=[Outcome.FAILED, Outcome.CANCELLED]).order_by("-started_at").first()
    return (retrying.filter(started_at__gt=ended.started_at) if ended else retrying).count()


# --- Maintenance -----------------------------------------------------------------------------

def rollup_task_runs(*, older_than_days: int, batch: int = 5000) -> int:
    """Fold finished task runs older than the retention into TaskRunDaily, then delete them.

    Idempotent and safe to run concurrently: each batch is locked (SKIP LOCKED), added to the
    daily rows with atomic increments and deleted in one transaction. Returns rows rolled up.
    """
    cutoff = timezone.now() - dt.timedelta(days=older_than_days)
    total = 0
    while True:
        with transaction.atomic():
            ids = list(
                TaskRun.objects.select_for_update(skip_locked=True)
                .filter(started_at__lt=cutoff, finished_at__isnull=False)
                .order_by("pk").values_list("pk", flat=True)[:batch]
            )
            if not ids:
                return total
            groups = (
                TaskRun.objects.filter(pk__in=ids)
                .annotate(day=TruncDate("started_at"))
                .values("day", "account_id", "job", "queue", "outcome")
                .annotate(runs=Count("pk"), cpu=Sum("cpu_ms"), wall=Sum("wall_ms"), db=Sum("db_wait_ms"),
                          storage=Sum("storage_wait_ms"), n_items=Sum("items"))
            )
            for g in groups:
                key = {k: g[k] for k in ("day", "account_id", "job", "queue", "outcome")}
                row, _ = TaskRunDaily.objects.get_or_create(**key)
                TaskRunDaily.objects.filter(pk=row.pk).update(
                    runs=F("runs") + g["runs"], cpu_ms=F("cpu_ms") + g["cpu"], wall_ms=F("wall_ms") + g["wall"],
                    db_wait_ms=F("db_wait_ms") + g["db"], storage_wait_ms=F("storage_wait_ms") + g["storage"],
                    items=F("items") + g["n_items"],
                )
            TaskRun.objects.filter(pk__in=ids).delete()
            total += len(ids)


def prune_django_q(*, older_than_days: int) -> int:
    """Delete django-q2's own task rows (it keeps failures forever) and stale worker heartbeats."""
    from django_q.models import Task

    cutoff = timezone.now() - dt.timedelta(days=older_than_days)
    tasks, _ = Task.objects.filter(stopped__lt=cutoff).delete()
    beats, _ = WorkerHeartbeat.objects.filter(seen_at__lt=cutoff).delete()
    return tasks + beats
