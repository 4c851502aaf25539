"""The usage log's contribution to /metrics and /healthz (see scheduling.monitoring): how far the
relay is behind, in events and in seconds. Nothing while the usage log is off."""
from django.conf import settings
from django.db import connection
from prometheus_client.core import GaugeMetricFamily

from scheduling import monitoring
from usage.models import UsageEvent

# The outbox's extent and its oldest row: three probes of the primary key's index, whatever the
# outbox holds (a count would read every row, and the outbox grows while the log is down). The
# relay deletes in id order, so the span is the count but for ids of rolled-back transactions.
LAG = (f"SELECT COALESCE(max(id) - min(id) + 1, 0) AS events, "
       f"COALESCE(EXTRACT(EPOCH FROM now() - (SELECT created_at FROM {UsageEvent._meta.db_table} ORDER BY id LIMIT 1)), 0) "
       f"AS seconds FROM {UsageEvent._meta.db_table}")


def relay_lag() -> tuple[int, float]:
    """(events waiting for the relay, age in seconds of the oldest)."""
    with connection.cursor() as cursor:
        cursor.execute(LAG)
        events, seconds = cursor.fetchone()
    return int(events), max(0.0, float(seconds))


@monitoring.metrics
def usage_metrics():
    if not settings.FAIRSHARE["USAGE_NATS_URL"]:
        return
    events, seconds = relay_lag()
    yield GaugeMetricFamily("fairshare_usage_relay_lag_events", "Usage events written, not yet in the log",
                            value=events)
    yield GaugeMetricFamily("fairshare_usage_relay_lag_seconds", "Age of the oldest usage event not yet in the log",
                            value=seconds)


@monitoring.health_check("usage_relay")
def usage_relay_keeps_up() -> str | None | dict:
    if not settings.FAIRSHARE["USAGE_NATS_URL"]:
        return {}  # no part at all: /healthz does not list what is off
    events, seconds = relay_lag()
    if seconds > settings.FAIRSHARE["USAGE_RELAY_BEHIND_S"]:
        return f"behind: {events} events wait, the oldest for {seconds:.0f} s (is usage_relay running, NATS up?)"
    return None
