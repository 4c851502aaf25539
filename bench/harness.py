"""Shared plumbing for Fairshare's benchmarks (not a benchmark itself).

- each benchmark owns a PostgreSQL database (created and migrated here, never the one DATABASE_URL
  names): DATABASE_URL's server (default postgres://postgres@127.0.0.1:5432) with the benchmark's
  database name, or BENCH_DATABASE_URL verbatim;
- real `manage.py qcluster` processes with the ORM broker in that database, started and stopped
  by `scheduling.processes` (the one process control of tests, benchmarks and `rehearse`), and
  stopped at exit whatever happens;
- machine information for the reports (percentiles and tables: `scheduling.reporting`).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # `python bench/x.py` puts bench/ first on sys.path, not the repo

from scheduling import processes  # noqa: E402  (importable before django.setup())
from scheduling.processes import Cluster  # noqa: E402
# The one percentile and table renderer, here for the benchmarks as h.median, h.render_table, ...
from scheduling.reporting import fmt, median, percentile, render_table  # noqa: E402, F401
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_SERVER_URL = "postgres://postgres@127.0.0.1:5432/postgres"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- Database and environment -------------------------------------------------------------------

def bench_database_url(db_name: str) -> str:
    if os.environ.get("BENCH_DATABASE_URL"):
        return os.environ["BENCH_DATABASE_URL"]
    parts = urlsplit(os.environ.get("DATABASE_URL") or DEFAULT_SERVER_URL)
    if parts.scheme not in {"postgres", "postgresql", "pgsql"}:
        sys.exit(f"the benchmark needs PostgreSQL; DATABASE_URL has scheme {parts.scheme!r}")
    return urlunsplit(parts._replace(path="/" + db_name, query=""))


def redact_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password:
        return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))
    return url


def configure_environment(db_url: str, *, test_jobs: bool = True) -> None:
    """Settings for this process (and the children that inherit its environment).

    test_jobs: register tests.jobs (tests.sleep), here and in workers started from this environment,
    to enqueue them. Benchmarks that run only product jobs (scheduling.noop, exports.build) leave
    it out.
    """
    os.environ["DATABASE_URL"] = db_url
    os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
    os.environ.setdefault("SECRET_KEY", "bench-only-not-secret")
    os.environ["LOG_LEVEL"] = "WARNING"  # this process only; workers log at the production default
    # The benchmarks' Django test client (bench/dashboard.py) speaks plain HTTP: no redirect to https://.
    os.environ["SECURE_SSL_REDIRECT"] = "0"
    if test_jobs:
        os.environ["FAIRSHARE_EXTRA_JOB_MODULES"] = "tests.jobs"
    os.environ.pop("REDIS_URL", None)  # the ORM broker, in the benchmark's own database
    os.environ.pop("Q_CLUSTER_NAME", None)


def cluster_env(*, workers: int | None = None, poll: float | None, **extra: str) -> dict[str, str]:
    """A worker's environment (scheduling.processes.worker_env): this benchmark's database, with
    `workers` processes on the default queue, `poll` seconds between broker polls (None: the
    product's default), logging at INFO."""
    if workers is not None:
        extra["FAIRSHARE_WORKERS"] = str(workers)
    if poll is not None:
        extra["FAIRSHARE_POLL"] = str(poll)
    return processes.worker_env(without={"FAIRSHARE_POLL"} if poll is None else (), LOG_LEVEL="INFO", **extra)


def setup_django() -> None:
    import django

    django.setup()


def ensure_database(db_url: str, *, fresh: bool = False) -> None:
    import psycopg
    from psycopg import sql

    name = urlsplit(db_url).path.lstrip("/")
    admin_url = urlunsplit(urlsplit(db_url)._replace(path="/postgres"))
    with psycopg.connect(admin_url, autocommit=True) as admin:
        exists = admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
        if exists and fresh:
            log(f"dropping database {name}")
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
            exists = False
        if not exists:
            log(f"creating database {name}")
            admin.execute(sql.SQL("CREATE DATABASE {} ENCODING 'UTF8' TEMPLATE template0").format(sql.Identifier(name)))


def drop_database(db_url: str) -> None:
    import psycopg
    from psycopg import sql

    name = urlsplit(db_url).path.lstrip("/")
    with psycopg.connect(urlunsplit(urlsplit(db_url)._replace(path="/postgres")), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    log(f"dropped database {name}")


def migrate() -> None:
    log("manage.py migrate")
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=REPO,
                   env=dict(os.environ), check=True, timeout=600)


def prepare(db_name: str, *, fresh: bool, drop: bool, test_jobs: bool = True) -> str:
    """A benchmark's start: cleanup on exit and SIGTERM, its own database created (or recreated with
    `fresh`, dropped at exit with `drop`) and migrated, Django set up. Returns the database URL."""
    install_cleanup()
    db_url = bench_database_url(db_name)
    configure_environment(db_url, test_jobs=test_jobs)
    ensure_database(db_url, fresh=fresh)
    if drop:
        _cleanups.insert(0, lambda: drop_database(db_url))  # last, after the clusters have stopped
    migrate()  # idempotent, and quick when there is nothing to apply
    setup_django()
    return db_url


def reset_tables(*labels: str) -> None:
    """Empty the given models' tables (the database is the benchmark's own)."""
    from django.apps import apps
    from django.db import connection

    tables = [apps.get_model(label)._meta.db_table for label in labels]
    with connection.cursor() as cur:
        # CASCADE: rows that point at these (export attempts, reservations) go too.
        cur.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables) + " CASCADE")


RUN_TABLES = ("scheduling.TaskRun", "scheduling.DeferredTask", "scheduling.Backlog", "budgets.Reservation", "budgets.UsageDay",
              "django_q.OrmQ", "django_q.Task")


# --- Processes ----------------------------------------------------------------------------------

def start_cluster(env: dict[str, str], log_path: Path, queue: str = "default") -> Cluster:
    """A real `manage.py qcluster`, stopped at exit (or on SIGTERM) if the benchmark has not."""
    cluster = Cluster(queue, env, log_path)
    at_exit(cluster.stop)
    return cluster


_cleanups: list = []


def at_exit(cleanup) -> None:
    """Run `cleanup()` when the benchmark ends, however it ends (last registered, first run)."""
    _cleanups.append(cleanup)


def _run_cleanups() -> None:
    while _cleanups:
        with contextlib.suppress(Exception):
            _cleanups.pop()()


def _on_signal(signum, frame):
    raise SystemExit(128 + signum)  # so that `finally` blocks (and the cluster stops) run


def install_cleanup() -> None:
    signal.signal(signal.SIGTERM, _on_signal)
    atexit.register(_run_cleanups)


def run(main) -> None:
    """`sys.exit(main())`, running the registered cleanups however main ends."""
    try:
        sys.exit(main())
    finally:
        _run_cleanups()


def wait_until(predicate, *, timeout: float, interval: float = 0.01, what: str, cluster: Cluster | None = None):
    deadline = time.perf_counter() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if cluster is not None and not cluster.alive():
            raise RuntimeError(f"the qcluster exited ({cluster.returncode}) while waiting for {what}:\n"
                               f"{cluster.tail(40)}")
        if time.perf_counter() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def broker_empty(key: str = "default") -> bool:
    """Every message of the queue acknowledged (django-q2's monitor deletes the OrmQ row on ack)."""
    from django_q.models import OrmQ

    return not OrmQ.objects.filter(key=key).exists()


def machine_cpu_seconds() -> float | None:
    """CPU time the whole machine has spent busy (every process: benchmark, cluster, PostgreSQL;
    /proc/stat, all CPUs), for the difference over a measured stretch; None off Linux."""
    try:
        with open("/proc/stat") as f:
            jiffies = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = jiffies[:7]  # (not steal: another guest's)
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")  # (guest time is in user)


# --- Reporting ----------------------------------------------------------------------------------

PG_SETTINGS = ("shared_buffers", "synchronous_commit", "fsync", "max_connections")


def machine_info(db_url: str, *, pg_settings: tuple[str, ...] = PG_SETTINGS) -> dict:
    import django
    import psycopg
    from django.db import connection

    with connection.cursor() as cur:
        cur.execute("SELECT version()")
        pg_version = cur.fetchone()[0]
        shown = {}
        for name in pg_settings:
            cur.execute(f"SHOW {name}")
            shown[name] = cur.fetchone()[0]
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    mem_total_kb = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem_total_kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
    git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model,
        "mem_total_mib": round(mem_total_kb / 1024) if mem_total_kb else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "django_q2": _dist_version("django-q2"),
        "psycopg": psycopg.__version__,
        "psycopg_impl": psycopg.pq.__impl__,
        "postgresql": pg_version,
        "postgresql_settings": shown,
        "database": redact_url(db_url),
        "git_branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty_product_code": git("status", "--porcelain", "--", "budgets", "exports", "scheduling", "tasks", "config").splitlines(),
        # Identifies the exact product code measured (uncommitted changes included).
        "product_code_sha256": product_code_digest(),
        "loadavg_start": list(os.getloadavg()),
    }


def product_code_digest() -> str:
    """SHA-256 over the Python files of the product apps and config, as they are on disk."""
    import hashlib

    digest = hashlib.sha256()
    for app in ("budgets", "scheduling", "exports", "tasks", "config"):
        for path in sorted((REPO / app).rglob("*.py")):
            if "migrations" in path.parts and path.name != "__init__.py":
                continue
            digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _dist_version(name: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def print_load(results: dict) -> None:
    machine = results["machine"]
    print(f"load average {machine['loadavg_start'][0]:.2f} at start, {machine['loadavg_end'][0]:.2f} at the end")


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"results: {path}")


def utc_timestamp() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


# --- Where the database time goes ----------------------------------------------------------------

class WaitSampler:
    """Samples pg_stat_activity of one database every `interval` seconds from its own connection.

    Each sample counts what every other backend of the database is doing: running (active, no wait
    event), waiting for a row lock (Lock:transactionid / Lock:tuple), for the WAL flush of a commit
    (IO:WALSync / LWLock:WALWrite), idle in a transaction (the client is busy while holding its
    locks), or idle (between statements / tasks). samples x interval ~ backend-seconds.
    """

    def __init__(self, db_url: str, interval: float = 0.02):
        import threading

        self.db_url, self.interval = db_url, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wait-sampler", daemon=True)
        self.samples = 0
        self.states: dict[str, int] = {}
        self.statements: dict[str, int] = {}

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def classify(state: str | None, wtype: str | None, wevent: str | None) -> str:
        if state == "active":
            if wtype is None:
                return "active: running"
            if wtype == "Lock":
                return f"active: row/table lock wait ({wevent})"
            if wevent in {"WALSync", "WALWrite", "WALInsert"} or (wtype == "IO" and "WAL" in (wevent or "")):
                return f"active: WAL flush/write ({wevent})"
            return f"active: {wtype}:{wevent}"
        if state == "idle in transaction":
            return "idle in transaction"
        return state or "?"

    def _run(self) -> None:
        import psycopg

        name = urlsplit(self.db_url).path.lstrip("/")
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            while not self._stop.wait(self.interval):
                rows = conn.execute(
                    "SELECT state, wait_event_type, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 90) "
                    "FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid() "
                    "AND backend_type = 'client backend'", (name,)).fetchall()
                self.samples += 1
                for state, wtype, wevent, query in rows:
                    kind = self.classify(state, wtype, wevent)
                    self.states[kind] = self.states.get(kind, 0) + 1
                    if kind.startswith("active") or kind == "idle in transaction":
                        key = f"{kind} | {query}"
                        self.statements[key] = self.statements.get(key, 0) + 1

    def summary(self, top: int = 12) -> dict:
        s = self.interval
        return {
            "interval_s": s, "samples": self.samples,
            "backend_seconds": {k: round(v * s, 2) for k, v in sorted(self.states.items(), key=lambda kv: -kv[1])},
            "top_statements_backend_seconds": {
                k: round(v * s, 2) for k, v in sorted(self.statements.items(), key=lambda kv: -kv[1])[:top]},
        }
