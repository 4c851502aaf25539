"""Budgets' contribution to /metrics (see scheduling.monitoring): today's CPU use against the daily
budget, the weight and the rate limit with the starts in its window, of the accounts that used the most (FAIRSHARE["METRICS_ACCOUNTS"] of them: with thousands of
tenants a series per account would be endless), in a few queries whatever their number."""
from django.conf import settings
from prometheus_client.core import GaugeMetricFamily

from budgets.selectors import budget_status
from scheduling import monitoring


@monitoring.metrics
def budget_metrics():
    used = GaugeMetricFamily("fairshare_budget_cpu_used_seconds", "CPU charged today", labels=["account", "queue"])
    limit = GaugeMetricFamily("fairshare_budget_cpu_limit_seconds", "Daily CPU budget", labels=["account", "queue"])
    weight = GaugeMetricFamily("fairshare_budget_weight", "Share of busy workers against other accounts'",
                               labels=["account", "queue"])
    rate = GaugeMetricFamily("fairshare_rate_limit_starts", "Rate limit: starts allowed per window",
                             labels=["account", "queue", "period_s"])
    recent = GaugeMetricFamily("fairshare_rate_window_starts", "Starts in the rate limit's window now (up to the limit)",
                               labels=["account", "queue", "period_s"])
    for row in budget_status(top=settings.FAIRSHARE["METRICS_ACCOUNTS"] or None):
        limit.add_metric([row.account, row.queue], row.cpu_limit_ms / 1000)
        used.add_metric([row.account, row.queue], row.cpu_used_ms / 1000)
        weight.add_metric([row.account, row.queue], row.weight)
        if row.rate_starts is not None:
            rate.add_metric([row.account, row.queue, str(row.rate_period_s)], row.rate_starts)
            recent.add_metric([row.account, row.queue, str(row.rate_period_s)], row.recent_starts)
    yield from (used, limit, weight, rate, recent)
