"""One round: start the workers, replay the backlog against them, wait, and measure it from the
durable records (TaskRun, ExportRecord) alone."""
import datetime as dt
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from django.db import connection
from django.utils import timezone

from budgets.models import Account
from exports.models import FINISHED_STATUSES, ExportRecord, ExportStatus
from exports.rehearsal.plan import (
    DEFAULT_QUEUE_WORKERS, SMALL_JOB, RehearsalError, RehearsalPlan, backlog, export_scope, reset, worker_env,
)
from exports.requests import BUILD_JOB, export_request
from scheduling.models import Outcome, TaskRun
from scheduling.processes import Cluster, ClusterError, stop_all, wait_ready
from scheduling.reporting import percentile
from scheduling.runtime import enqueue

STOP_TIMEOUT_S = 30
POLL_S = 0.5
ERROR_OUTCOMES = (Outcome.FAILED, Outcome.LOST, Outcome.REJECTED)
TERMINAL_OUTCOMES = (Outcome.SUCCEEDED, Outcome.SKIPPED, Outcome.CANCELLED, *ERROR_OUTCOMES)


@dataclass
class RoundResult:
    concurrency: int
    exports_requested: int
    exports_succeeded: int
    small_jobs_requested: int
    small_jobs_done: int
    rows_exported: int
    makespan_s: float               # first export enqueued -> last export completed
    exports_per_minute: float       # useful (succeeded) exports / makespan
    oldest_job_age_s: float         # the longest any job waited from enqueue to start
    oldest_export_age_s: float
    p95_latency_s: float            # enqueue -> finish, all jobs
    p95_export_latency_s: float
    p95_small_job_latency_s: float
    errors: int                     # failed, lost and rejected runs, plus jobs left unfinished
    unfinished: int
    retries: int
    deferrals: int
    cpu_share: float                # of the exports' summed wall time
    db_wait_share: float
    storage_wait_share: float
    # The rest of the wall time: waiting for a CPU (the run queue of a busy host) and unmetered work.
    other_share: float
    peak_rss_mib: float             # the largest export worker's peak RSS during a run
    load_before: float              # host 1-minute load average at the start of the round
    load_after: float               # ... when the backlog was done
    peak_db_connections: int
    timed_out: bool
    logs: list[str] = field(default_factory=list)


@dataclass
class Sent:
    """What a round enqueued, each at the time this process read just before enqueueing it."""
    enqueued: dict[tuple[str, str], dt.datetime] = field(default_factory=dict)  # (job, ref) -> time
    export_ids: list[str] = field(default_factory=list)
    small_refs: list[str] = field(default_factory=list)


def run_round(*, account: Account, user, plan: RehearsalPlan, concurrency: int, run_id: str, log_dir: Path,
              say=print) -> RoundResult:
    reset(account)
    load_before = os.getloadavg()[0]
    started = timezone.now()
    env = worker_env(export_workers=concurrency)
    clusters = [
        Cluster("exports", env, log_dir / f"c{concurrency}-exports.log"),
        Cluster("default", env, log_dir / f"c{concurrency}-default.log"),
    ]
    try:
        try:
            wait_ready(clusters, {"exports": concurrency, "default": DEFAULT_QUEUE_WORKERS}, since=started)
        except ClusterError as exc:
            raise RehearsalError(str(exc)) from exc
        say(f"  concurrency {concurrency}: workers ready, enqueueing {plan.exports} exports "
            f"and {plan.small_jobs} small jobs")
        sent = _send(account=account, user=user, plan=plan, run_id=run_id, concurrency=concurrency)
        peak_connections, timed_out = _wait_done(sent, clusters, timeout_s=plan.timeout_s)
        load_after = os.getloadavg()[0]
    finally:
        stop_all(clusters, timeout=STOP_TIMEOUT_S)
    return _measure(concurrency=concurrency, sent=sent, load=(load_before, load_after),
                    peak_connections=peak_connections, timed_out=timed_out, logs=[str(c.log_path) for c in clusters])


def _send(*, account: Account, user, plan: RehearsalPlan, run_id: str, concurrency: int) -> Sent:
    sent = Sent()
    for kind, i in backlog(plan.exports, plan.small_jobs):
        at = timezone.now()
        if kind == "export":
            start, end = export_scope(i)
            record, _ = export_request(account_slug=account.slug, user=user, start=start, end=end,
                                       idempotency_key=f"rehearsal-{run_id}-c{concurrency}-{i}")
            sent.export_ids.append(str(record.pk))
            sent.enqueued[(BUILD_JOB, str(record.pk))] = at
        else:
            ref = f"rehearsal:{run_id}:c{concurrency}:{i}"
            enqueue(job=SMALL_JOB, account=account.pk, ref=ref)
            sent.small_refs.append(ref)
            sent.enqueued[(SMALL_JOB, ref)] = at
    return sent


def _wait_done(sent: Sent, clusters: list[Cluster], *, timeout_s: float) -> tuple[int, bool]:
    """Until every export and small job has finished, or a cluster died, or `timeout_s` passed.
    Returns the peak count of database connections seen, and whether it timed out."""
    deadline = time.monotonic() + timeout_s
    peak_connections = 0
    while True:
        peak_connections = max(peak_connections, _db_connections())
        exports_done = ExportRecord.objects.filter(pk__in=sent.export_ids, status__in=FINISHED_STATUSES).count()
        small_done = (TaskRun.objects.filter(job=SMALL_JOB, ref__in=sent.small_refs, outcome__in=TERMINAL_OUTCOMES)
                      .values("ref").distinct().count())
        if exports_done == len(sent.export_ids) and small_done == len(sent.small_refs):
            return peak_connections, False
        if time.monotonic() > deadline or not all(c.alive() for c in clusters):
            return peak_connections, True
        time.sleep(POLL_S)


def _db_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def _measure(*, concurrency: int, sent: Sent, load: tuple[float, float], peak_connections: int,
             timed_out: bool, logs: list[str]) -> RoundResult:
    now = timezone.now()
    runs = list(TaskRun.objects.filter(ref__in=[ref for _, ref in sent.enqueued]).order_by("started_at", "pk"))
    records = {str(r.pk): r for r in ExportRecord.objects.filter(pk__in=sent.export_ids)}
    export_waits, export_latencies, unfinished_exports = _export_times(sent, records, now)
    small_waits, small_latencies, unfinished_small = _small_job_times(sent, runs, now)
    unfinished = unfinished_exports + unfinished_small
    succeeded = [records[e] for e in sent.export_ids if records[e].status == ExportStatus.SUCCEEDED]
    first_export_at = min(at for (job, _), at in sent.enqueued.items() if job == BUILD_JOB)
    last_done = max((r.completed_at for r in succeeded), default=now)
    makespan_s = max(0.001, (last_done - first_export_at).total_seconds())
    return RoundResult(
        concurrency=concurrency,
        exports_requested=len(sent.export_ids), exports_succeeded=len(succeeded),
        small_jobs_requested=len(sent.small_refs), small_jobs_done=len(sent.small_refs) - unfinished_small,
        rows_exported=sum(r.row_count or 0 for r in succeeded),
        makespan_s=round(makespan_s, 3),
        exports_per_minute=round(len(succeeded) / makespan_s * 60, 3),
        oldest_job_age_s=round(max(small_waits + export_waits, default=0.0), 3),
        oldest_export_age_s=round(max(export_waits, default=0.0), 3),
        p95_latency_s=_p95(export_latencies + small_latencies),
        p95_export_latency_s=_p95(export_latencies),
        p95_small_job_latency_s=_p95(small_latencies),
        errors=sum(r.outcome in ERROR_OUTCOMES for r in runs) + unfinished, unfinished=unfinished,
        retries=sum(r.outcome == Outcome.RETRYING for r in runs),
        deferrals=sum(r.outcome == Outcome.DEFERRED for r in runs),
        **_time_shares([r for r in runs if r.job == BUILD_JOB]),
        load_before=round(load[0], 2), load_after=round(load[1], 2),
        peak_db_connections=peak_connections, timed_out=timed_out, logs=logs,
    )


def _export_times(sent: Sent, records: dict[str, ExportRecord], now: dt.datetime):
    """Each export's wait (enqueue -> started) and latency (enqueue -> finished), in seconds; an
    unfinished export counts until now. Returns (waits, latencies, unfinished count)."""
    waits, latencies, unfinished = [], [], 0
    for export_id in sent.export_ids:
        record, at = records[export_id], sent.enqueued[(BUILD_JOB, export_id)]
        finished = record.status in FINISHED_STATUSES
        unfinished += not finished
        waits.append(((record.started_at or now) - at).total_seconds())
        latencies.append(((record.completed_at if finished else now) - at).total_seconds())
    return waits, latencies, unfinished


def _small_job_times(sent: Sent, runs: list[TaskRun], now: dt.datetime):
    """The same for the small jobs, from their runs (a retried job has several; the first start
    and the last finish count)."""
    by_ref: dict[str, list[TaskRun]] = {}
    for run in runs:
        by_ref.setdefault(run.ref, []).append(run)
    waits, latencies, unfinished = [], [], 0
    for ref in sent.small_refs:
        at, ref_runs = sent.enqueued[(SMALL_JOB, ref)], by_ref.get(ref, [])
        done = [r for r in ref_runs if r.outcome in TERMINAL_OUTCOMES and r.finished_at]
        unfinished += not done
        waits.append(((ref_runs[0].started_at if ref_runs else now) - at).total_seconds())
        latencies.append(((done[-1].finished_at if done else now) - at).total_seconds())
    return waits, latencies, unfinished


def _time_shares(export_runs: list[TaskRun]) -> dict[str, float]:
    """Where the exports' summed wall time went, and the largest peak RSS of one run."""
    wall = sum(r.wall_ms for r in export_runs) or 1
    metered = sum(r.cpu_ms + r.db_wait_ms + r.storage_wait_ms for r in export_runs)
    return {
        "cpu_share": round(sum(r.cpu_ms for r in export_runs) / wall, 4),
        "db_wait_share": round(sum(r.db_wait_ms for r in export_runs) / wall, 4),
        "storage_wait_share": round(sum(r.storage_wait_ms for r in export_runs) / wall, 4),
        "other_share": round(max(0.0, 1 - metered / wall), 4),
        "peak_rss_mib": round(max((r.peak_rss_kb for r in export_runs), default=0) / 1024, 1),
    }


def _p95(values: list[float]) -> float:
    return round(percentile(values, 95) or 0.0, 3)
