"""Budgets' contribution to /metrics (see scheduling.monitoring): today's CPU use against each
account's daily budget."""
from prometheus_client.core import GaugeMetricFamily

from budgets import clock
from budgets.models import Budget, UsageDay
from scheduling import monitoring


@monitoring.metrics
def budget_metrics():
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
