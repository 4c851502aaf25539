"""Database connections: the cursor for Fairshare's own hot statements, bound server-side and
prepared once per connection (these WITH statements cost more to plan than to run: settlement
0.28–0.42 ms planning, 0.09–0.18 ms execution); the statements of a .sql file by name, and one
run with the statements sent along with it (one round trip). FAIRSHARE["PREPARED_STATEMENTS"] = False turns preparing off, for a pooler that cannot keep
prepared statements across transactions (PgBouncer before 1.21 in transaction mode).
"""
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
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
        # for: a threshold no statement reaches, for this statement only, leaves Django's own as they were.
        conn = self.connection
        threshold = conn.prepare_threshold
        if threshold is None:
            conn.prepare_threshold = _NEVER_AUTOMATICALLY
        try:
            return super().execute(query, params, prepare=True, binary=binary)
        finally:
            conn.prepare_threshold = threshold


class _LoggedCursor(CursorDebugWrapper):
    """Django's query log (DEBUG, CaptureQueriesContext) with the statement's values composed in."""

    def execute(self, sql, params=None):
        with self.debug_sql(self.db.ops.compose_sql(sql, params) if params else sql):
            return CursorWrapper.execute(self, sql, params)


def cursor() -> CursorWrapper:
    """Django's cursor for this thread's default connection (its wrappers included), preparing."""
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
    """The statements of a .sql file by name, each from its `-- name: <name>` line to the next, its
    comment lines left out, its lines stripped and joined by one space (psycopg caches its placeholders'
    conversion for statements of at most 4,096 bytes given at most 50 parameters)."""
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
    connection (`fetch_one`: the chain's admission or settlement), in its round
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


def fetch_one(statement: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
    """Run one of Fairshare's own statements (prepared: `cursor`), and what `send_along` queued after
    it; its first row by column name."""
    return next(iter(fetch_all(statement, params)), None)


def fetch_all(statement: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`fetch_one`, every row."""
    return _execute(statement, params, lambda c: named_rows(statement, c))


# Each statement's column names, by its text and column count (a column added by a migration while
# it runs counts one more): psycopg builds `description` anew on every access, an object a column.
_NAMES: dict[tuple[str, int], tuple[str, ...]] = {}


def named_rows(statement: str, c: CursorWrapper) -> list[dict[str, Any]]:
    """The rows `statement` returned on `c`, each by column name (none when it returns no rows)."""
    result = c.pgresult
    fields = result.nfields if result is not None else 0
    if not fields:
        return []
    names = _NAMES.get((statement, fields))
    if names is None:
        names = _NAMES[(statement, fields)] = tuple(column.name for column in c.description)
    return [dict(zip(names, row)) for row in c.fetchall()]
