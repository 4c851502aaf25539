"""The database settings (config/settings.py takes them from here): DATABASE_URL, PostgreSQL only,
and the options every session gets."""
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config import demo_env, env
from usage import conf as usage_conf


def session_timeouts() -> dict[str, int]:
    """What one PostgreSQL session may hold, and for how long (config/env.py; system check
    scheduling.E008 keeps them in order): the server itself ends a frozen process's transaction and
    frees its row locks, whatever that process does. 0 leaves the server's or the role's value
    (behind a pooler that refuses startup options, set them on the role instead: docs/deploy.md)."""
    return {
        "idle_in_transaction_session_timeout": env.DB_IDLE_IN_TRANSACTION_TIMEOUT.read(),
        "lock_timeout": env.DB_LOCK_TIMEOUT.read(),
        "statement_timeout": env.DB_STATEMENT_TIMEOUT.read(),
    }


def databases(*, var_dir: Path, timeouts: dict[str, int]) -> dict:
    """DATABASES, from DATABASE_URL. Persistent connections, checked before reuse: django-q2 calls
    close_old_connections() around every task in every worker and in the monitor, which with
    CONN_MAX_AGE = 0 means a new database connection per task; the health check also replaces a
    connection that died while idle before a task uses it.

    PostgreSQL only (the ledger, the broker's claims and the exports' COPY are PostgreSQL
    statements): anything else is refused here, before any command runs, rather than failing later
    in the first query. Every connection (web, workers, an export's COPY reader, management
    commands) gets the session `timeouts` and, in a process that has FAIRSHARE_USAGE_NATS_URL, the
    session setting on which the usage log's events are written (docs/usage-log.md): without it
    nothing is written and no outbox grows."""
    url = env.DATABASE_URL.read()
    default = dj_database_url.parse(url, conn_max_age=env.DB_CONN_MAX_AGE.read(), conn_health_checks=True) if url else {}
    if default.get("ENGINE") != "django.db.backends.postgresql":
        scheme = url.partition(":")[0]
        raise ImproperlyConfigured(
            f"DATABASE_URL must be a PostgreSQL URL (postgres://USER[:PASSWORD]@HOST:PORT/NAME); it is "
            f"{scheme + ': Fairshare runs on PostgreSQL only' if scheme else 'not set'}. Beside a running "
            f"scripts/demo, commands find its embedded PostgreSQL in {var_dir / demo_env.FILE_NAME}.")
    options = default.setdefault("OPTIONS", {})
    options["options"] = " ".join(filter(None, [
        options.get("options", ""),
        *(f"-c {name}={seconds}s" for name, seconds in timeouts.items() if seconds),
        f"-c {usage_conf.EVENTS_GUC}=1" if usage_conf.NATS_URL.read() else ""]))
    return {"default": default}
