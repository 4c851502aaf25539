"""A worker's database connections kept healthy between tasks: a quiet one trusted without a round
trip, a dead or unusable one closed (not Django's every-connection close), and a write that must land
after the work is done tried again across a dropped connection.
"""
import select
import time
from collections.abc import Callable
from typing import TypeVar

from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections

T = TypeVar("T")

# How recently a connection must have served a task for its quiet socket to be trusted: one idle
# for longer may have been dropped without a word (a NAT's idle timeout), which only a round trip finds.
TRUST_QUIET_FOR_S = 5.0


def trust_quiet_connection() -> None:
    """At a task's start, spare Django's health check (a round trip a task) when the connection served
    the previous task moments ago and its socket has nothing to read: an idle session receives nothing
    it did not ask for, so anything there (the server's goodbye, end of file) means it is gone."""
    connection = connections[DEFAULT_DB_ALIAS]
    raw = connection.connection
    if raw is None:
        return
    now = time.monotonic()
    previous = getattr(connection, "_fairshare_previous_task", None)
    connection._fairshare_previous_task = (raw, now)
    if (connection.health_check_done or previous is None or previous[0] is not raw
            or now - previous[1] > TRUST_QUIET_FOR_S or raw.closed or raw.broken
            or select.select([raw.fileno()], [], [], 0)[0]):
        return
    connection.health_check_done = True


def close_old_connections() -> None:
    """Close this thread's connections that died or were left unusable. Not Django's: that also closes
    those past CONN_MAX_AGE (with 0, every one: a connection a task), and inside a caller's transaction
    (django-q2 `sync` mode, an on-commit callback) it would close the connection under its caller."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"] or (conn.errors_occurred and not conn.is_usable()):
            conn.close()
        elif conn.errors_occurred:
            conn.errors_occurred = False


# Writes that must land after the work is done (settlement, the run's record): tries, and the pause
# before the n-th retry (n x this).
RECONNECT_ATTEMPTS = 5
RECONNECT_DELAY_S = 0.5


def retry_on_disconnect(write: Callable[[], T]) -> T:
    """Run `write` (one transaction, safe to run again), reconnecting and trying again when the
    database connection dropped (a failover, a proxy restart): the work it would lose is done."""
    for attempt in range(1, RECONNECT_ATTEMPTS + 1):
        try:
            return write()
        except (OperationalError, InterfaceError):
            if attempt == RECONNECT_ATTEMPTS:
                raise
            close_old_connections()
            time.sleep(RECONNECT_DELAY_S * attempt)
