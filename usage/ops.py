"""The usage log's contribution to /metrics and /healthz (see scheduling.monitoring): how far the
relay is behind, in events and in seconds. Nothing while the usage log is off."""
from django.conf import settings
from django.db import connection
from prometheus_client.core import GaugeMetricFamily

from scheduling import monitoring
from usage.relay import QUERIES

def relay_lag() -> tuple[int, float]:
    """(events waiting for the relay, age in seconds of the oldest)."""
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["lag"])
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
