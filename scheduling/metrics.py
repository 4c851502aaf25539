"""Prometheus metrics, computed from the database at scrape time.

Every figure comes from shared state (our tables and the broker), not from per-process counters,
so any number of web and worker processes report one consistent picture (multi-process safe by
construction; prometheus-client's multiprocess mode is not needed).
"""
from django.conf import settings
from django.db.models import Count, Min, Sum
from django.utils import timezone
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from budgets import clock
from budgets.models import Budget, UsageDay
from exports.models import ExportRecord, ExportStatus
from scheduling.liveness import queue_health
from scheduling.models import DeferredTask, Outcome, TaskRun, TaskRunDaily

# Counter family suffix -> (the TaskRun / TaskRunDaily field it sums, help text).
TASK_SECONDS = {
    "cpu": ("cpu_ms", "Process CPU time of task runs"),
    "db_wait": ("db_wait_ms", "Time waiting on the database"),
    "storage_wait": ("storage_wait_ms", "Time waiting on export storage"),
    "wall": ("wall_ms", "Wall time of task runs"),
}
FAILURE_OUTCOMES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)


class FairshareCollector:
    def collect(self):
        depth = GaugeMetricFamily("fairshare_queue_depth", "Messages waiting in the broker", labels=["queue"])
        age = GaugeMetricFamily("fairshare_queue_oldest_age_seconds", "Age of the oldest waiting message",
                                labels=["queue"])
        alive = GaugeMetricFamily(
            "fairshare_workers_alive",
            f"Workers heard from in the last {settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s", labels=["queue"])
        stalled = GaugeMetricFamily(
            "fairshare_queue_stalled",
            f"1 when a message waited over {settings.FAIRSHARE['QUEUE_STALL_AFTER_S']} s, no task started for as "
            "long and none is running: the pool is stuck whatever its heartbeats say", labels=["queue"])
        for health in queue_health():
            depth.add_metric([health.queue], health.depth)
            age.add_metric([health.queue], health.oldest_age_s)
            alive.add_metric([health.queue], health.workers)
            stalled.add_metric([health.queue], int(health.stalled))
        yield depth
        yield age
        yield alive
        yield stalled

        held = GaugeMetricFamily("fairshare_held_tasks", "Jobs in the holding area", labels=["queue", "reason"])
        for row in DeferredTask.objects.values("queue", "reason").annotate(n=Count("pk")).order_by():
            held.add_metric([row["queue"], row["reason"]], row["n"])
        oldest_held = DeferredTask.objects.aggregate(t=Min("created_at"))["t"]
        yield held
        yield GaugeMetricFamily("fairshare_held_oldest_age_seconds", "Age of the oldest held job",
                                value=(timezone.now() - oldest_held).total_seconds() if oldest_held else 0)

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

        day = clock.budget_day()
        used = GaugeMetricFamily("fairshare_budget_cpu_used_seconds", "CPU charged today", labels=["account", "queue"])
        limit = GaugeMetricFamily("fairshare_budget_cpu_limit_seconds", "Daily CPU budget", labels=["account", "queue"])
        usage = {(u["account__slug"], u["queue"]): u["cpu_used_ms"]
                 for u in UsageDay.objects.filter(day=day).values("account__slug", "queue", "cpu_used_ms")}
        for b in Budget.objects.values("account__slug", "queue", "cpu_seconds_per_day").order_by("account__slug", "queue"):
            key = (b["account__slug"], b["queue"])
            limit.add_metric(list(key), b["cpu_seconds_per_day"])
            used.add_metric(list(key), usage.get(key, 0) / 1000)
        yield used
        yield limit

        exported = ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED).aggregate(
            rows=Sum("row_count"), size=Sum("byte_size"), n=Count("pk"))
        yield GaugeMetricFamily("fairshare_exports_retained", "Succeeded exports still stored", value=exported["n"])
        yield GaugeMetricFamily("fairshare_export_rows_retained", "Rows in stored exports", value=exported["rows"] or 0)
        yield GaugeMetricFamily("fairshare_export_bytes_retained", "Bytes of stored exports", value=exported["size"] or 0)
        by_status = GaugeMetricFamily("fairshare_exports", "Exports by status", labels=["status"])
        for row in ExportRecord.objects.values("status").annotate(n=Count("pk")).order_by():
            by_status.add_metric([row["status"]], row["n"])
        yield by_status
