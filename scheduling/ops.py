"""The kernel's contributions to /metrics and /healthz (see scheduling.monitoring): the broker's
queues and their workers (scheduling.liveness), the holding area, task runs and the database.
"""
from django.conf import settings
from django.db import connection
from django.db.models import Count, Min, OuterRef, Subquery, Sum
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from budgets.models import Queue
from scheduling import clock, monitoring
from scheduling.liveness import queue_health, queue_problem
from scheduling.holding import LINE_ORDER
from scheduling.models import Backlog, DeadLetter, DeferredTask, Outcome, TaskRun, TaskRunDaily
from scheduling.waits import held_counts

# Counter family suffix -> (the TaskRun / TaskRunDaily field it sums, help text).
TASK_SECONDS = {
    "cpu": ("cpu_ms", "Process CPU time of task runs"),
    "db_wait": ("db_wait_ms", "Time waiting on the database"),
    "storage_wait": ("storage_wait_ms", "Time waiting on export storage"),
    "wall": ("wall_ms", "Wall time of task runs"),
}
FAILURE_OUTCOMES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)


@monitoring.metrics
def queue_metrics():
    depth = GaugeMetricFamily("fairshare_queue_depth", "Messages waiting in the broker", labels=["queue"])
    age = GaugeMetricFamily("fairshare_queue_oldest_age_seconds", "Age of the oldest waiting message",
                            labels=["queue"])
    alive = GaugeMetricFamily(
        "fairshare_workers_alive",
        f"Workers heard from in the last {settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s", labels=["queue"])
    stalled = GaugeMetricFamily(
        "fairshare_queue_stalled",
        f"1 when work waited over {settings.FAIRSHARE['QUEUE_STALL_AFTER_S']} s in a pool that no idle worker of "
        "it takes, or a message waited as long in the broker with no task started and none running: a pool is "
        "stuck whatever its heartbeats say", labels=["queue"])
    for health in queue_health():
        depth.add_metric([health.queue], health.depth)
        age.add_metric([health.queue], health.oldest_age_s)
        alive.add_metric([health.queue], health.workers)
        stalled.add_metric([health.queue], int(health.stalled))
    yield depth
    yield age
    yield alive
    yield stalled


@monitoring.metrics
def held_metrics():
    # From the holding area's counts and the heads of the accounts' lines: what a scrape reads
    # follows the number of accounts, never the number of held jobs.
    held = GaugeMetricFamily("fairshare_held_tasks", "Jobs in the holding area", labels=["queue", "reason"])
    for (queue, reason), n in sorted(held_counts(backlogs=Backlog.objects.all(), account_less=True).items()):
        held.add_metric([queue, reason], n)
    head = (DeferredTask.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"),
                                        in_line_since__isnull=False).order_by(*LINE_ORDER).values("in_line_since")[:1])
    oldest = Backlog.objects.filter(lined=True).annotate(head=Subquery(head)).aggregate(t=Min("head"))["t"]
    yield held
    yield GaugeMetricFamily("fairshare_held_oldest_age_seconds",
                            "How long the first job of the account line that has waited longest has been in line",
                            value=(clock.now() - oldest).total_seconds() if oldest else 0)


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


@monitoring.health_check("database")
def database_reachable() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        return f"unreachable ({type(exc).__name__})"
    return None


@monitoring.health_check("workers")
def workers_doing_work() -> dict[str, str | None]:
    """Per queue: workers heard from recently, and not stalled (see scheduling.liveness)."""
    try:
        health = queue_health()
    except Exception as exc:
        return {q: f"unknown ({type(exc).__name__})" for q in Queue.values}
    return {h.queue: queue_problem(h) for h in health}


@monitoring.metrics
def dead_letter_metrics():
    # One row per dead message (scheduling.dead_letters): few, grouped by queue.
    dead = CounterMetricFamily("fairshare_dead_letters", "RabbitMQ messages dead-lettered with a reason, by queue",
                               labels=["queue"])
    for queue, n in DeadLetter.objects.values_list("queue").annotate(n=Count("pk")).order_by("queue"):
        dead.add_metric([queue], n)
    yield dead
