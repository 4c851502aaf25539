"""The cursor for Fairshare's own hot statements: the admission, settlement, hand-off and enqueue
checks every task pays for, hand-written SQL of a few fixed shapes.

On PostgreSQL (psycopg 3) they are bound server-side and prepared once per connection: these
data-modifying WITH statements cost more to plan than to run (EXPLAIN ANALYZE on this project's
machines: settlement 0.28–0.42 ms planning against 0.09–0.18 ms execution; the account's standing
0.45 ms a time unprepared, 0.15 ms prepared). Django's own cursor binds on the client and prepares
nothing (`OPTIONS["prepare_threshold"]` only applies to server-side binding), so everything else
keeps it. FAIRSHARE["PREPARED_STATEMENTS"] = False turns this off, for a connection pooler that
cannot keep prepared statements across transactions (PgBouncer before 1.21 in transaction mode).
Elsewhere (SQLite) it is Django's cursor.
"""
import select
import time

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.backends.utils import CursorWrapper

try:
    import psycopg
    from django.db.backends.postgresql.base import CursorDebugWrapper
    from django.db.backends.postgresql.psycopg_any import register_tzloader
    from psycopg.pq import Format
except ImportError:  # pragma: no cover - SQLite-only installations
    psycopg = None


if psycopg is not None:
    _TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid
    _NEVER_AUTOMATICALLY = 2**31 - 1

    class _PreparedCursor(psycopg.Cursor):
        """A server-side binding cursor that prepares every statement it runs."""

        def execute(self, query, params=None, *, prepare=None, binary=None):
            # Django connects with prepare_threshold None, which turns preparing off even when asked
            # for: a threshold no statement reaches, for this statement only, prepares it and
            # leaves Django's own (client-side bound, never prepared) as they were.
            conn = self._conn
            threshold = conn.prepare_threshold
            if threshold is None:
                conn.prepare_threshold = _NEVER_AUTOMATICALLY
            try:
                return super().execute(query, params, prepare=True, binary=binary)
            finally:
                conn.prepare_threshold = threshold

    class _LoggedCursor(CursorDebugWrapper):
        """Django's query log (DEBUG, CaptureQueriesContext) shows the statement with its values
        (Django reads them from a client-side binding cursor, which this is not)."""

        def execute(self, sql, params=None):
            with self.debug_sql(self.db.ops.compose_sql(sql, params) if params else sql):
                return CursorWrapper.execute(self, sql, params)


def cursor() -> CursorWrapper:
    """Django's cursor for this thread's default connection (its execute wrappers, query logging
    and error wrapping included), preparing its statements where that is possible."""
    connection = connections[DEFAULT_DB_ALIAS]  # once: each attribute of django.db.connection is a lookup
    if psycopg is None or connection.vendor != "postgresql" or not settings.FAIRSHARE["PREPARED_STATEMENTS"]:
        return connection.cursor()
    connection.validate_thread_sharing()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = _PreparedCursor(connection.connection)
    if connection.timezone != raw.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT).timezone:
        register_tzloader(connection.timezone, raw)  # as Django's own cursors do
    return _LoggedCursor(raw, connection) if connection.queries_logged else connection.make_cursor(raw)


# How recently a connection must have served a task for its quiet socket to be trusted: a
# connection idle for longer may have been dropped without a word (a NAT's or firewall's idle
# timeout), which only a round trip finds.
TRUST_QUIET_FOR_S = 5.0


def trust_quiet_connection() -> None:
    """Spare the round trip of Django's health check (CONN_HEALTH_CHECKS: `SELECT 1` before a
    connection's first use after close_old_connections(), i.e. once per task in a worker) when the
    connection served the previous task moments ago (TRUST_QUIET_FOR_S) and its socket has nothing
    to read: an idle PostgreSQL session receives nothing it did not ask for, so anything there (the
    server's goodbye when the session was terminated or the server stopped, or end of file) means
    it is gone, and then Django's ping runs and replaces it. Called at the start of each task."""
    connection = connections[DEFAULT_DB_ALIAS]
    raw = connection.connection
    if psycopg is None or raw is None or connection.vendor != "postgresql":
        return
    now = time.monotonic()
    previous = getattr(connection, "_fairshare_previous_task", None)
    connection._fairshare_previous_task = (raw, now)
    if connection.health_check_done or previous is None or previous[0] is not raw:
        return
    if now - previous[1] > TRUST_QUIET_FOR_S or raw.closed or raw.broken:
        return
    if select.select([raw.fileno()], [], [], 0)[0]:
        return
    connection.health_check_done = True
