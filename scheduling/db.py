"""Database connections for the kernel and the apps: the cursor for Fairshare's own hot statements
(the admission, settlement, hand-off and enqueue checks every task pays for, hand-written SQL of a
few fixed shapes, named parameters), and keeping a worker's connections healthy between tasks.

On PostgreSQL (psycopg 3) they are bound server-side and prepared once per connection: these
data-modifying WITH statements cost more to plan than to run (EXPLAIN ANALYZE on this project's
machines: settlement 0.28–0.42 ms planning against 0.09–0.18 ms execution; the account's standing
0.45 ms a time unprepared, 0.15 ms prepared). Django's own cursor binds on the client and prepares
nothing (`OPTIONS["prepare_threshold"]` only applies to server-side binding), so everything else
keeps it. FAIRSHARE["PREPARED_STATEMENTS"] = False turns this off, for a connection pooler that
cannot keep prepared statements across transactions (PgBouncer before 1.21 in transaction mode).
"""
import re
import select
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections
from django.db.backends.postgresql.base import CursorDebugWrapper
from django.db.backends.postgresql.psycopg_any import register_tzloader
from django.db.backends.utils import CursorWrapper
from psycopg.pq import Format

T = TypeVar("T")

_TIMESTAMPTZ_OID = psycopg.adapters.types["timestamptz"].oid
_NEVER_AUTOMATICALLY = 2**31 - 1


class _PreparedCursor(psycopg.Cursor):
    """A server-side binding cursor that prepares every statement it runs."""

    def execute(self, query, params=None, *, prepare=None, binary=None):
        # Django connects with prepare_threshold None, which turns preparing off even when asked
        # for: a threshold no statement reaches, for this statement only, prepares it and
        # leaves Django's own (client-side bound, never prepared) as they were.
        conn = self.connection
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
    if not settings.FAIRSHARE["PREPARED_STATEMENTS"]:
        return connection.cursor()
    connection.validate_thread_sharing()
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = _PreparedCursor(connection.connection)
    if connection.timezone != raw.adapters.get_loader(_TIMESTAMPTZ_OID, Format.TEXT).timezone:
        register_tzloader(connection.timezone, raw)  # as Django's own cursors do
    return _LoggedCursor(raw, connection) if connection.queries_logged else connection.make_cursor(raw)


def load_queries(path: Path) -> dict[str, str]:
    """The statements of a .sql file, by name: each starts at a `-- name: <name>` line and runs to
    the next; its comment lines are left out, its lines joined by one space (so that psycopg keeps
    its conversion of the named placeholders: it caches statements of up to 4,096 bytes)."""
    queries: dict[str, str] = {}
    for chunk in re.split(r"^-- name: ", path.read_text(), flags=re.MULTILINE)[1:]:
        name, _, body = chunk.partition("\n")
        lines = (line.strip() for line in body.splitlines())
        queries[name.strip()] = " ".join(line for line in lines if line and not line.startswith("--")).rstrip(";")
    return queries


@dataclass(frozen=True)
class _Along:
    statement: str
    params: Callable[[], Mapping[str, Any]]
    then: Callable[[CursorWrapper], None]


def send_along(statement: str, params: Callable[[], Mapping[str, Any]], *,
               then: Callable[[CursorWrapper], None]) -> object:
    """Send `statement` right after the next of Fairshare's own statements on this thread's
    connection (`fetch_one`, `fetch_one_named`: the chain's admission or settlement), in its round
    trip and its transaction: one round trip and one commit for both (psycopg's pipeline mode; in
    autocommit the statements up to its one Sync are one implicit transaction, and an error in one
    rolls both back). `params()` is called when it is sent (the next statement's caller may set
    what it reads, a run's start time), `then(cursor)` once both are done, with its result. A
    statement it must not follow may take it along: it must hold whatever it needs in its own SQL
    (it does nothing when what it follows did not happen). `flush_along` sends what no statement
    took, `withdraw_along` takes it back unsent (the handle this returns). Without prepared
    statements (FAIRSHARE["PREPARED_STATEMENTS"] False) it is sent on its own, after the next one."""
    along = _Along(statement, params, then)
    connection = connections[DEFAULT_DB_ALIAS]
    connection.fairshare_along = (*getattr(connection, "fairshare_along", ()), along)
    return along


def withdraw_along(along: object) -> bool:
    """Take a statement `send_along` queued off the queue, unsent; False when it was sent."""
    connection = connections[DEFAULT_DB_ALIAS]
    pending = getattr(connection, "fairshare_along", ())
    if not any(queued is along for queued in pending):
        return False
    connection.fairshare_along = tuple(a for a in pending if a is not along)
    return True


def flush_along() -> None:
    """Send, on their own, the statements `send_along` queued that no statement took along."""
    connection = connections[DEFAULT_DB_ALIAS]
    while pending := getattr(connection, "fairshare_along", ()):
        first, connection.fairshare_along = pending[0], pending[1:]
        with cursor() as c:
            c.execute(first.statement, first.params())
            first.then(c)


def _execute(statement: str, params: Mapping[str, Any], read: Callable[[CursorWrapper], T]) -> T:
    """Run one of Fairshare's own statements, and what `send_along` queued after it (one pipeline)."""
    connection = connections[DEFAULT_DB_ALIAS]
    pending: tuple[_Along, ...] = tuple(getattr(connection, "fairshare_along", ()))
    if not pending:
        with cursor() as c:
            c.execute(statement, params)
            return read(c)
    if not settings.FAIRSHARE["PREPARED_STATEMENTS"]:
        with cursor() as c:
            c.execute(statement, params)
            result = read(c)
        flush_along()
        return result
    with cursor() as c:
        followers = [cursor() for _ in pending]
        try:
            with connection.wrap_database_errors, connection.connection.pipeline():
                c.execute(statement, params)
                for follower, along in zip(followers, pending):
                    follower.execute(along.statement, along.params())
            # Sent and committed (or in the caller's transaction): taken off the queue before their
            # readers run, which may queue more.
            connection.fairshare_along = getattr(connection, "fairshare_along", ())[len(pending):]
            result = read(c)
            for follower, along in zip(followers, pending):
                along.then(follower)
        finally:
            for follower in followers:
                follower.close()
    return result


def fetch_one(statement: str, params: Mapping[str, Any]) -> tuple | None:
    """Run one of Fairshare's own statements (prepared: `cursor`) and return its first row."""
    return _execute(statement, params, lambda c: c.fetchone())


def fetch_one_named(statement: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """`fetch_one`, the row read by column name (the statement names each column it returns)."""
    def read(c: CursorWrapper) -> dict[str, Any] | None:
        row = c.fetchone()
        return None if row is None else dict(zip([column.name for column in c.description], row))

    return _execute(statement, params, read)


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
    if raw is None:
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


def close_old_connections() -> None:
    """Close this thread's connections that died or were left unusable; keep healthy ones.

    Not Django's `close_old_connections()`: that also closes connections past CONN_MAX_AGE
    (with 0, every one, so a worker paid for a new database connection on every task); and inside
    a caller's transaction (django-q2 `sync` mode, a test, an on-commit callback run inside an outer
    atomic block) it would close the connection under its caller. A worker between tasks is never
    inside one, and a connection that saw an error is checked and replaced only if it is dead.
    """
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
            conn.close()
        elif conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                conn.close()


# Writes that must land after the work is done (settlement, the run's record): tries, and the pause
# before the n-th retry (n x this).
RECONNECT_ATTEMPTS = 5
RECONNECT_DELAY_S = 0.5


def retry_on_disconnect(write: Callable[[], T]) -> T:
    """Run `write`, reconnecting and trying again when the database connection dropped (a
    failover, a proxy restart, `pg_terminate_backend`): the classic transient failure, and the
    work it would lose is already done. `write` must be one transaction, safe to run again."""
    for attempt in range(1, RECONNECT_ATTEMPTS + 1):
        try:
            return write()
        except (OperationalError, InterfaceError):
            if attempt == RECONNECT_ATTEMPTS:
                raise
            close_old_connections()
            time.sleep(RECONNECT_DELAY_S * attempt)
