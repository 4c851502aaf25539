"""The capacity rehearsal: set the budget before raising processes (seed 003).

Replays one realistic backlog — N exports of the dedicated "rehearsal" account, then M small jobs
arriving while they run — against real `qcluster` processes, once per export-worker count, and compares what each count
bought: useful exports per minute, the oldest job's wait, p95 latency, errors, where the exports'
time went (CPU, database wait, storage wait), peak memory per worker and host load. The stop rule:
when one more step of concurrency improves throughput by less than 10% while the database-wait
share grows, stop raising it — more processes will not remove that bottleneck.

Run it against a scratch database: it creates the account "rehearsal" with its own activity rows
and, before every round, deletes that account's exports, files, task runs, held work and usage
(nothing of any other account). Exports use the configured export storage; e-mail goes to an
in-memory backend, so nobody is notified.
"""
import datetime as dt
import hashlib
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from itertools import pairwise
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.files.storage import FileSystemStorage
from django.db import connection, transaction
from django.utils import timezone

from budgets.models import Account, Budget, Membership, Plan, Queue, Reservation, Role, UsageDay
from exports import storage
from exports.models import FINISHED_STATUSES, ActivityEvent, ExportRecord, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.models import DeferredTask, Outcome, TaskRun, WorkerHeartbeat
from scheduling.runtime import enqueue

ACCOUNT_SLUG = "rehearsal"
USERNAME = "rehearsal-owner"
SMALL_JOB = "scheduling.noop"
DEFAULT_QUEUE_WORKERS = 2
# The activity spans the 90 days up to a fixed date, so every run exports the same rows.
LAST_DAY = dt.date(2025, 12, 31)
SPAN_DAYS = 90
# Export i covers the last 30, 60 or 90 days of it: a mix of sizes, the same in every round.
EXPORT_SPANS_DAYS = (30, 60, 90)
# The stop rule's threshold: a step that adds less throughput than this is not worth its cost.
MIN_GAIN = 0.10
READY_TIMEOUT_S = 90
STOP_TIMEOUT_S = 30
POLL_S = 0.5
ERROR_OUTCOMES = (Outcome.FAILED, Outcome.LOST, Outcome.REJECTED)
TERMINAL_OUTCOMES = (Outcome.SUCCEEDED, Outcome.SKIPPED, Outcome.CANCELLED, *ERROR_OUTCOMES)


class RehearsalError(Exception):
    pass


@dataclass(frozen=True)
class RehearsalPlan:
    concurrencies: tuple[int, ...]
    exports: int
    small_jobs: int
    rows: int
    timeout_s: float = 600


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
class Recommendation:
    concurrency: int
    memory_budget_mib: int          # peak RSS per active export x concurrency
    peak_rss_per_export_mib: float
    stopped: bool                   # whether the stop rule fired
    stopped_between: list[int] | None
    reason: str


# --- Setup and reset ------------------------------------------------------------------------

def ensure_account(*, rows: int, max_concurrency: int) -> tuple[Account, object]:
    """The rehearsal account, its owner, budgets that never limit it, and exactly `rows` rows."""
    User = get_user_model()
    with transaction.atomic():
        account, _ = Account.objects.get_or_create(
            slug=ACCOUNT_SLUG, defaults={"name": "Capacity rehearsal", "plan": Plan.ENTERPRISE})
        user, _ = User.objects.get_or_create(username=USERNAME, defaults={"email": "rehearsal@example.invalid"})
        Membership.objects.get_or_create(user=user, account=account, defaults={"role": Role.OWNER})
        # Budgets must not be what limits a round: a huge daily allowance, and slots to spare
        # (a duplicate delivery briefly takes a slot too).
        slots = 2 * max(max_concurrency, DEFAULT_QUEUE_WORKERS)
        for queue in Queue.values:
            Budget.objects.update_or_create(account=account, queue=queue, defaults={
                "cpu_seconds_per_day": 1_000_000_000, "max_concurrent": slots})
    if ActivityEvent.objects.filter(account=account).count() != rows:
        _seed_activity(account, rows)
    return account, user


def _seed_activity(account: Account, rows: int) -> None:
    from budgets.management.commands.seed_demo import DESCRIPTIONS, EVENT_TYPES

    rng = random.Random(int(hashlib.sha256(f"{ACCOUNT_SLUG}:{rows}".encode()).hexdigest()[:12], 16))
    first = dt.datetime.combine(LAST_DAY - dt.timedelta(days=SPAN_DAYS - 1), dt.time.min, tzinfo=dt.UTC)
    span_s = SPAN_DAYS * 24 * 3600
    with transaction.atomic():
        ActivityEvent.objects.filter(account=account).delete()
        table = ActivityEvent._meta.db_table
        with connection.cursor() as cursor, cursor.copy(
            f"COPY {table} (account_id, occurred_at, actor_email, event_type, amount, description) FROM STDIN"
        ) as copy:
            for _ in range(rows):
                copy.write_row((
                    account.pk, first + dt.timedelta(seconds=rng.randrange(span_s)),
                    f"user{rng.randrange(50)}@{ACCOUNT_SLUG}.example", rng.choice(EVENT_TYPES),
                    Decimal(rng.randrange(-50_000, 500_000)) / 100, rng.choice(DESCRIPTIONS),
                ))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {table}")


def reset(account: Account) -> None:
    """Forget the previous round: the account's exports (and files), runs, held work, usage and
    any message of it still in the broker."""
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    for export_id in ExportRecord.objects.filter(account=account).values_list("pk", flat=True):
        storage.delete(key=storage.object_key(account_id=account.pk, export_id=export_id))
    with transaction.atomic():
        ExportRecord.objects.filter(account=account).delete()
        TaskRun.objects.filter(account=account).delete()
        DeferredTask.objects.filter(account=account).delete()
        Reservation.objects.filter(account=account).delete()
        UsageDay.objects.filter(account=account).delete()
        stale = []
        for pk, payload in OrmQ.objects.filter(key__in=Queue.values).values_list("pk", "payload"):
            try:
                message = SignedPackage.loads(payload)["args"][0]
            except Exception:
                continue
            if isinstance(message, dict) and message.get("account") == account.pk:
                stale.append(pk)
        OrmQ.objects.filter(pk__in=stale).delete()


# --- Worker processes -----------------------------------------------------------------------

def database_url() -> str:
    """The URL of the database this process uses (also under pytest), for worker processes."""
    db = connection.settings_dict
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{quote(db['NAME'], safe='')}"


def worker_env(*, export_workers: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "Q_CLUSTER_NAME"}
    env.update(
        DJANGO_SETTINGS_MODULE=os.environ.get("DJANGO_SETTINGS_MODULE", "config.settings"),
        SECRET_KEY=settings.SECRET_KEY,
        DATABASE_URL=database_url(),
        FAIRSHARE_EXPORT_WORKERS=str(export_workers),
        FAIRSHARE_WORKERS=str(DEFAULT_QUEUE_WORKERS),
        EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend",  # notify nobody
        PYTHONUNBUFFERED="1",
    )
    exports_storage = storage.export_storage()
    if isinstance(exports_storage, FileSystemStorage):
        env["FAIRSHARE_EXPORTS_ROOT"] = str(exports_storage.location)
    return env


class Cluster:
    """A `manage.py qcluster` in its own session; stopped by its main PID, then the session."""

    def __init__(self, queue: str, env: dict[str, str], log_path: Path):
        if queue != "default":
            env = {**env, "Q_CLUSTER_NAME": queue}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"], cwd=settings.BASE_DIR, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15) -> None:
        self.terminate()
        self.finish(time.monotonic() + timeout)

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)  # graceful: running tasks finish and are saved

    def finish(self, deadline: float) -> None:
        try:
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its session
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


def stop_all(clusters: list[Cluster]) -> None:
    for cluster in clusters:
        cluster.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for cluster in clusters:
        cluster.finish(deadline)


def _wait_ready(clusters: list[Cluster], wanted: dict[str, int], since: dt.datetime) -> None:
    """Until every worker process has said it is alive (its first heartbeat comes at spawn)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        beats = dict.fromkeys(wanted, 0)
        for queue in WorkerHeartbeat.objects.filter(seen_at__gte=since).values_list("queue", flat=True):
            if queue in beats:
                beats[queue] += 1
        if all(beats[q] >= n for q, n in wanted.items()):
            return
        dead = [c for c in clusters if not c.alive()]
        if dead or time.monotonic() > deadline:
            why = "exited" if dead else f"not ready after {READY_TIMEOUT_S} s ({beats} of {wanted})"
            raise RehearsalError(f"worker cluster {why}:\n" + "\n".join(c.tail() for c in dead or clusters))
        time.sleep(POLL_S)


def _db_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


# --- One round ------------------------------------------------------------------------------

def _backlog(n_exports: int, n_small: int) -> list[tuple[str, int]]:
    """The same traffic every round: the exports first (the backlog being measured), then the small
    jobs, which arrive while the exports run, like API traffic competing for the same host."""
    return [("export", i) for i in range(n_exports)] + [("small", j) for j in range(n_small)]


def export_scope(i: int) -> tuple[dt.date, dt.date]:
    days = EXPORT_SPANS_DAYS[i % len(EXPORT_SPANS_DAYS)]
    return LAST_DAY - dt.timedelta(days=days - 1), LAST_DAY


def p95(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


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
        _wait_ready(clusters, {"exports": concurrency, "default": DEFAULT_QUEUE_WORKERS}, started)
        say(f"  concurrency {concurrency}: workers ready, enqueueing {plan.exports} exports "
            f"and {plan.small_jobs} small jobs")

        enqueued: dict[tuple[str, str], dt.datetime] = {}
        export_ids: list[str] = []
        for kind, i in _backlog(plan.exports, plan.small_jobs):
            at = timezone.now()
            if kind == "export":
                start, end = export_scope(i)
                record, _ = export_request(account_slug=account.slug, user=user, start=start, end=end,
                                           idempotency_key=f"rehearsal-{run_id}-c{concurrency}-{i}")
                export_ids.append(str(record.pk))
                enqueued[(BUILD_JOB, str(record.pk))] = at
            else:
                ref = f"rehearsal:{run_id}:c{concurrency}:{i}"
                enqueue(job=SMALL_JOB, account=account.pk, ref=ref)
                enqueued[(SMALL_JOB, ref)] = at
        small_refs = [ref for job, ref in enqueued if job == SMALL_JOB]

        deadline = time.monotonic() + plan.timeout_s
        peak_connections, timed_out = 0, False
        while True:
            peak_connections = max(peak_connections, _db_connections())
            exports_done = ExportRecord.objects.filter(pk__in=export_ids, status__in=FINISHED_STATUSES).count()
            small_done = (TaskRun.objects.filter(job=SMALL_JOB, ref__in=small_refs, outcome__in=TERMINAL_OUTCOMES)
                          .values("ref").distinct().count())
            if exports_done == len(export_ids) and small_done == len(small_refs):
                break
            if time.monotonic() > deadline or not all(c.alive() for c in clusters):
                timed_out = True
                break
            time.sleep(POLL_S)
        load_after = os.getloadavg()[0]
    finally:
        stop_all(clusters)
    return _measure(concurrency=concurrency, enqueued=enqueued, export_ids=export_ids, small_refs=small_refs,
                    load_before=load_before, load_after=load_after, peak_connections=peak_connections,
                    timed_out=timed_out, logs=[str(c.log_path) for c in clusters])


def _measure(*, concurrency, enqueued, export_ids, small_refs, load_before, load_after, peak_connections,
             timed_out, logs) -> RoundResult:
    """Figures of one round, from the durable records (TaskRun, ExportRecord) alone."""
    now = timezone.now()
    t0 = min(at for (job, _), at in enqueued.items() if job == BUILD_JOB)
    refs = [ref for _, ref in enqueued]
    runs = list(TaskRun.objects.filter(ref__in=refs).order_by("started_at", "pk"))
    by_ref: dict[str, list[TaskRun]] = {}
    for run in runs:
        by_ref.setdefault(run.ref, []).append(run)

    waits, export_waits, export_latencies, small_latencies = [], [], [], []
    unfinished_exports = unfinished_small = 0
    records = {str(r.pk): r for r in ExportRecord.objects.filter(pk__in=export_ids)}
    for export_id in export_ids:
        record, at = records[export_id], enqueued[(BUILD_JOB, export_id)]
        started_at = record.started_at or now
        finished_at = record.completed_at if record.status in FINISHED_STATUSES else now
        unfinished_exports += record.status not in FINISHED_STATUSES
        export_waits.append((started_at - at).total_seconds())
        export_latencies.append((finished_at - at).total_seconds())
    for ref in small_refs:
        at = enqueued[(SMALL_JOB, ref)]
        ref_runs = by_ref.get(ref, [])
        done = [r for r in ref_runs if r.outcome in TERMINAL_OUTCOMES and r.finished_at]
        unfinished_small += not done
        waits.append(((ref_runs[0].started_at if ref_runs else now) - at).total_seconds())
        small_latencies.append(((done[-1].finished_at if done else now) - at).total_seconds())
    waits += export_waits
    unfinished = unfinished_exports + unfinished_small
    latencies = export_latencies + small_latencies

    succeeded = [records[e] for e in export_ids if records[e].status == ExportStatus.SUCCEEDED]
    last_done = max((r.completed_at for r in succeeded), default=now)
    makespan_s = max(0.001, (last_done - t0).total_seconds())
    export_runs = [r for r in runs if r.job == BUILD_JOB]
    wall = sum(r.wall_ms for r in export_runs) or 1
    metered = sum(r.cpu_ms + r.db_wait_ms + r.storage_wait_ms for r in export_runs)
    errors = sum(r.outcome in ERROR_OUTCOMES for r in runs) + unfinished
    return RoundResult(
        concurrency=concurrency,
        exports_requested=len(export_ids), exports_succeeded=len(succeeded),
        small_jobs_requested=len(small_refs), small_jobs_done=len(small_refs) - unfinished_small,
        rows_exported=sum(r.row_count or 0 for r in succeeded),
        makespan_s=round(makespan_s, 3),
        exports_per_minute=round(len(succeeded) / makespan_s * 60, 3),
        oldest_job_age_s=round(max(waits, default=0.0), 3),
        oldest_export_age_s=round(max(export_waits, default=0.0), 3),
        p95_latency_s=round(p95(latencies), 3),
        p95_export_latency_s=round(p95(export_latencies), 3),
        p95_small_job_latency_s=round(p95(small_latencies), 3),
        errors=errors, unfinished=unfinished,
        retries=sum(r.outcome == Outcome.RETRYING for r in runs),
        deferrals=sum(r.outcome == Outcome.DEFERRED for r in runs),
        cpu_share=round(sum(r.cpu_ms for r in export_runs) / wall, 4),
        db_wait_share=round(sum(r.db_wait_ms for r in export_runs) / wall, 4),
        storage_wait_share=round(sum(r.storage_wait_ms for r in export_runs) / wall, 4),
        other_share=round(max(0.0, 1 - metered / wall), 4),
        peak_rss_mib=round(max((r.peak_rss_kb for r in export_runs), default=0) / 1024, 1),
        load_before=round(load_before, 2), load_after=round(load_after, 2),
        peak_db_connections=peak_connections, timed_out=timed_out, logs=logs,
    )


# --- Comparison -----------------------------------------------------------------------------

def recommend(rounds: list[RoundResult]) -> Recommendation:
    """Apply the stop rule, then choose the smallest concurrency that gets (within 10%) the best
    throughput seen before the rule fired: more workers that add little only cost memory and
    database connections."""
    ordered = sorted(rounds, key=lambda r: r.concurrency)
    considered, stopped_between, notes = [ordered[0]], None, []
    for prev, nxt in pairwise(ordered):
        gain = (nxt.exports_per_minute / prev.exports_per_minute - 1) if prev.exports_per_minute else math.inf
        if gain < MIN_GAIN and nxt.db_wait_share > prev.db_wait_share:
            stopped_between = [prev.concurrency, nxt.concurrency]
            notes.append(
                f"fired from {prev.concurrency} to {nxt.concurrency} workers: throughput {gain:+.1%} "
                f"(< {MIN_GAIN:.0%}) while the DB-wait share grew {prev.db_wait_share:.0%} -> {nxt.db_wait_share:.0%}")
            break
        considered.append(nxt)
    if stopped_between is None:
        notes.append("did not fire within the tried concurrencies")
    healthy = [r for r in considered if not r.errors and not r.timed_out] or considered
    best = max(r.exports_per_minute for r in healthy)
    chosen = min((r for r in healthy if r.exports_per_minute >= (1 - MIN_GAIN) * best), key=lambda r: r.concurrency)
    notes.append(f"{chosen.concurrency} is the smallest concurrency within {MIN_GAIN:.0%} of the best throughput "
                 f"({best:.1f} exports/min)" + ("" if healthy == considered else " among error-free rounds"))
    return Recommendation(
        concurrency=chosen.concurrency,
        memory_budget_mib=math.ceil(chosen.peak_rss_mib * chosen.concurrency),
        peak_rss_per_export_mib=chosen.peak_rss_mib,
        stopped=stopped_between is not None, stopped_between=stopped_between,
        reason="; ".join(notes),
    )


COLUMNS = [
    ("workers", "concurrency", "{}"),
    ("exports ok", None, None),
    ("exp/min", "exports_per_minute", "{:.1f}"),
    ("makespan s", "makespan_s", "{:.1f}"),
    ("oldest wait s", "oldest_job_age_s", "{:.1f}"),
    ("p95 s", "p95_latency_s", "{:.2f}"),
    ("p95 export s", "p95_export_latency_s", "{:.1f}"),
    ("p95 small s", "p95_small_job_latency_s", "{:.2f}"),
    ("errors", "errors", "{}"),
    ("cpu %", "cpu_share", "{:.0%}"),
    ("db wait %", "db_wait_share", "{:.0%}"),
    ("storage %", "storage_wait_share", "{:.0%}"),
    ("other %", "other_share", "{:.0%}"),
    ("peak RSS MiB", "peak_rss_mib", "{:.0f}"),
    ("load 1m", None, None),
    ("db conns", "peak_db_connections", "{}"),
]


def table(rounds: list[RoundResult]) -> str:
    rows = []
    for r in rounds:
        row = []
        for title, attr, fmt in COLUMNS:
            if title == "exports ok":
                row.append(f"{r.exports_succeeded}/{r.exports_requested}")
            elif title == "load 1m":
                row.append(f"{r.load_before:.1f}->{r.load_after:.1f}")
            else:
                row.append(fmt.format(getattr(r, attr)))
        rows.append(row)
    widths = [max(len(t), *(len(row[i]) for row in rows)) for i, (t, _, _) in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line([t for t, _, _ in COLUMNS]), line(["-" * w for w in widths]), *map(line, rows)])


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def rehearse(plan: RehearsalPlan, *, say=print) -> dict:
    """Run every round of `plan`, compare them and return the report (also what goes to JSON)."""
    if connection.vendor != "postgresql":
        raise RehearsalError("the rehearsal needs PostgreSQL: concurrent workers are what it measures")
    # SIGTERM, like Ctrl-C, unwinds through each round's `finally`, which stops its clusters.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupted) if in_main_thread else None
    try:
        return _rehearse(plan, say=say)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _rehearse(plan: RehearsalPlan, *, say) -> dict:
    account, user = ensure_account(rows=plan.rows, max_concurrency=max(plan.concurrencies))
    run_id = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix=f"fairshare-rehearsal-{run_id}-"))
    say(f"Rehearsal {run_id}: {plan.exports} exports + {plan.small_jobs} small jobs over {plan.rows} rows, "
        f"export workers {', '.join(map(str, plan.concurrencies))} (worker logs in {log_dir})")
    rounds = []
    for concurrency in plan.concurrencies:
        result = run_round(account=account, user=user, plan=plan, concurrency=concurrency, run_id=run_id,
                           log_dir=log_dir, say=say)
        say(f"  concurrency {concurrency}: {result.exports_succeeded}/{result.exports_requested} exports in "
            f"{result.makespan_s:.1f} s, {result.errors} errors" + (" (TIMED OUT)" if result.timed_out else ""))
        rounds.append(result)
    recommendation = recommend(rounds)
    db = connection.settings_dict
    return {
        "run_id": run_id,
        "finished_at": timezone.now().isoformat(),
        "plan": {**asdict(plan), "concurrencies": list(plan.concurrencies),
                 "default_queue_workers": DEFAULT_QUEUE_WORKERS,
                 "account": ACCOUNT_SLUG, "export_spans_days": list(EXPORT_SPANS_DAYS), "min_gain": MIN_GAIN},
        # Where it ran, without credentials.
        "host": {"cpus": os.cpu_count(), "database": f"{db['HOST'] or 'localhost'}/{db['NAME']}",
                 "broker": "redis" if "redis" in settings.Q_CLUSTER else "orm"},
        "rounds": [asdict(r) for r in rounds],
        "table": table(rounds),
        "recommendation": asdict(recommendation),
    }
