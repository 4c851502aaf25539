"""The tasks app's contribution to /metrics (see scheduling.monitoring): Django task calls still
waiting or running, per queue, and how long the oldest waiting one has waited. (Finished calls are
counted by the kernel's task-run families, per job: tasks.run.<queue>, tasks.system.<queue>.)"""
from django.db.models import Count, Min
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily

from scheduling import monitoring
from tasks.models import UNFINISHED, TaskCall


@monitoring.metrics
def task_call_metrics():
    # Reads the unfinished calls only (their partial index), however many finished ones are kept.
    rows = (TaskCall.objects.filter(status__in=UNFINISHED).values("queue", "status")
            .annotate(n=Count("pk"), oldest=Min("enqueued_at")).order_by())
    calls = GaugeMetricFamily("fairshare_task_calls", "Django task calls waiting (READY) or running, per queue",
                              labels=["queue", "status"])
    age = GaugeMetricFamily("fairshare_task_calls_oldest_ready_seconds",
                            "Age of the oldest Django task call still waiting, per queue", labels=["queue"])
    now = timezone.now()
    for row in rows:
        calls.add_metric([row["queue"], row["status"]], row["n"])
        if row["status"] == "READY":
            age.add_metric([row["queue"]], (now - row["oldest"]).total_seconds())
    yield calls
    yield age
