"""The kernel's contributions to /metrics and /healthz (see scheduling.monitoring): the broker's
queues, the holding area, task runs, the database and live workers.
"""
import datetime as dt

from django.conf import settings
from django.db import connection
from django.db.models import Count, Min, Sum
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.models import OrmQ
from django_q.signing import SignedPackage
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from budgets.models import Queue
from scheduling import monitoring
from scheduling.models import DeferredTask, Outcome, TaskRun, TaskRunDaily, WorkerHeartbeat

# Counter family suffix -> (the TaskRun / TaskRunDaily field it sums, help text).
TASK_SECONDS = {
    "cpu": ("cpu_ms", "Process CPU time of task runs"),
    "db_wait": ("db_wait_ms", "Time waiting on the database"),
    "storage_wait": ("storage_wait_ms", "Time waiting on export storage"),
    "wall": ("wall_ms", "Wall time of task runs"),
}
FAILURE_OUTCOMES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)


def _oldest_enqueued_at(queue: str, broker) -> dt.datetime | None:
    """When the oldest message still waiting in `queue` was enqueued (ORM and Redis brokers)."""
    if isinstance(broker, ORM):  # also the FifoORM subclass configured in settings
        row = OrmQ.objects.filter(key=queue).order_by("id").values_list("payload", flat=True).first()
    elif broker.__class__.__name__ == "Redis":
        row = broker.connection.lindex(broker.list_key, 0)
    else:
        return None
    if row is None:
        return None
    try:
        return SignedPackage.loads(row)["started"]
    except Exception:
        return None


def queue_depths() -> list[tuple[str, int, float]]:
    """(queue, messages waiting, age of the oldest in seconds) per queue."""
    now = timezone.now()
    rows = []
    for queue in Queue.values:
        broker = get_broker(queue)
        oldest = _oldest_enqueued_at(queue, broker)
        rows.append((queue, broker.queue_size() or 0, (now - oldest).total_seconds() if oldest else 0.0))
    return rows


@monitoring.metrics
def queue_metrics():
    depth = GaugeMetricFamily("fairshare_queue_depth", "Messages waiting in the broker", labels=["queue"])
    age = GaugeMetricFamily("fairshare_queue_oldest_age_seconds", "Age of the oldest waiting message",
                            labels=["queue"])
    for queue, size, oldest in queue_depths():
        depth.add_metric([queue], size)
        age.add_metric([queue], oldest)
    yield depth
    yield age


@monitoring.metrics
def held_metrics():
    held = GaugeMetricFamily("fairshare_held_tasks", "Jobs in the holding area", labels=["queue", "reason"])
    for row in DeferredTask.objects.values("queue", "reason").annotate(n=Count("pk")).order_by():
        held.add_metric([row["queue"], row["reason"]], row["n"])
    oldest_held = DeferredTask.objects.aggregate(t=Min("created_at"))["t"]
    yield held
    yield GaugeMetricFamily("fairshare_held_oldest_age_seconds", "Age of the oldest held job",
                            value=(timezone.now() - oldest_held).total_seconds() if oldest_held else 0)


@monitoring.metrics
def task_run_metrics():
    # Totals over live task runs plus the daily roll-ups of pruned ones: monotonic counters.
    totals: dict[tuple[str, str], dict[str, int]] = {}
    for qs, count_runs in ((TaskRun.objects, Count("pk")), (TaskRunDaily.objects, Sum("runs"))):
        aggregates = {"runs": count_runs, **{name: Sum(f) for name, (f, _) in TASK_SECONDS.items()}}
        for row in qs.values("job", "outcome").annotate(**aggregates).order_by():
            bucket = totals.setdefault((row["job"], row["outcome"]), dict.fromkeys(aggregates, 0))
            for k in aggregates:
                bucket[k] += row[k] or 0
    runs = CounterMetricFamily("fairshare_task_runs", "Task runs by job and outcome", labels=["job", "outcome"])
    failures = CounterMetricFamily("fairshare_task_failures", "Failed task runs (incl. retried) by job",
                                   labels=["job", "outcome"])
    seconds = {
        name: CounterMetricFamily(f"fairshare_task_{name}_seconds", help_, labels=["job"])
        for name, (_, help_) in TASK_SECONDS.items()
    }
    per_job: dict[str, dict[str, int]] = {}
    for (job, outcome), b in sorted(totals.items()):
        runs.add_metric([job, outcome], b["runs"])
        if outcome in FAILURE_OUTCOMES:
            failures.add_metric([job, outcome], b["runs"])
        acc = per_job.setdefault(job, dict.fromkeys(TASK_SECONDS, 0))
        for k in acc:
            acc[k] += b[k]
    for job, acc in per_job.items():
        for name, total_ms in acc.items():
            seconds[name].add_metric([job], total_ms / 1000)
    yield runs
    yield failures
    yield from seconds.values()


@monitoring.metrics
def worker_metrics():
    alive = GaugeMetricFamily(
        "fairshare_workers_alive",
        f"Workers heard from in the last {settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s", labels=["queue"])
    for queue, n in live_workers().items():
        alive.add_metric([queue], n)
    yield alive


def live_workers() -> dict[str, int]:
    """Worker processes per queue heard from within FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"]
    (what /healthz and /metrics both call alive)."""
    since = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
    rows = WorkerHeartbeat.objects.filter(seen_at__gte=since).values("queue").annotate(n=Count("pk")).order_by()
    return {row["queue"]: row["n"] for row in rows}


@monitoring.health_check("database")
def database_reachable() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        return f"unreachable ({type(exc).__name__})"
    return None


@monitoring.health_check("workers")
def workers_heard_from() -> dict[str, str | None]:
    """A queue is fine when one of its workers wrote its heartbeat recently."""
    max_age = settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"]
    try:
        alive = live_workers()
    except Exception as exc:
        return {q: f"unknown ({type(exc).__name__})" for q in Queue.values}
    return {q: None if q in alive else f"no worker heard from in {max_age} s" for q in Queue.values}
