"""Budgets' contribution to /metrics (see scheduling.monitoring): today's CPU use against the daily
budget of the accounts that used the most (FAIRSHARE["METRICS_ACCOUNTS"] of them: with thousands of
tenants a series per account would be endless), in a few queries whatever their number."""
from django.conf import settings
from prometheus_client.core import GaugeMetricFamily

from budgets.selectors import budget_status
from scheduling import monitoring


@monitoring.metrics
def budget_metrics():
    used = GaugeMetricFamily("fairshare_budget_cpu_used_seconds", "CPU charged today", labels=["account", "queue"])
    limit = GaugeMetricFamily("fairshare_budget_cpu_limit_seconds", "Daily CPU budget", labels=["account", "queue"])
    for row in budget_status(top=settings.FAIRSHARE["METRICS_ACCOUNTS"] or None):
        limit.add_metric([row.account, row.queue], row.cpu_limit_ms / 1000)
        used.add_metric([row.account, row.queue], row.cpu_used_ms / 1000)
    yield used
    yield limit
