#!/usr/bin/env python
"""Fairshare beside the Python PostgreSQL queues: no-op jobs drained by two workers (issue 27).

    .venv/bin/python bench/peers.py            # 2,000 jobs per system, 3 rounds (~10 min, first run + installs)
    .venv/bin/python bench/peers.py --quick    # 300 jobs per system, 2 rounds
    .venv/bin/python bench/peers.py --systems procrastinate,fairshare-chain --jobs 1000
    .venv/bin/python bench/peers.py --systems procrastinate,fairshare-chain,fairshare-many,fairshare-many-wide,\
        fairshare-tasks,fairshare-chain-redis --jobs 1000 --rounds 1 --db-prefix peers_mine   # every path

Systems, each with two workers:

- procrastinate: Procrastinate 3.10, one `procrastinate worker` with concurrency 2 (its defaults
  otherwise: LISTEN/NOTIFY, jobs kept), a synchronous no-op task;
- django-tasks-db: django-tasks 0.12 + django-tasks-db 0.13, two `manage.py db_worker` processes
  (CONN_MAX_AGE 60, DEBUG off, its defaults otherwise), a no-op `@task`;
- fairshare-bare: bare django-q2 with Fairshare's settings (`async_task("bench.noop.noop", ...)`,
  bench/budget_overhead.py's bare path), one `manage.py qcluster`, 2 workers, ORM broker;
- fairshare-recorded: the same cluster running `bench.noop.recorded` (a TaskRun inserted and
  completed, nothing else: budget_overhead's recorded path);
- fairshare-chain: Fairshare's full chain, `scheduling.runtime.enqueue(job="scheduling.noop")` for
  budget_overhead's account (budget and cap never bind): a metered TaskRun, a slot, a charge;
- fairshare-many, fairshare-many-wide: the same jobs sent with one `enqueue_many` (the call made for
  floods), for an account whose cap is the number of workers (2), and for budget_overhead's, whose cap
  is far above them;
- fairshare-tasks: the same through the Tasks API, `bench.tasks_noop.noop.enqueue(account=)` for
  budget_overhead's account (a stored call, claimed and completed, around the chain's run);
- fairshare-tenants: the same, the jobs alternating between two such accounts (not a goal: both
  workers then write two accounts' rows, not one's);
- fairshare-chain-redis, fairshare-chain-rabbitmq: the full chain with the Redis broker
  (FAIRSHARE_TEST_REDIS_URL, else local db 15) and the RabbitMQ broker (FAIRSHARE_TEST_RABBITMQ_URL,
  else local guest; quorum queues of this run's own, deleted after each round). Their jobs left are
  counted as N minus the runs succeeded (the broker's messages are not in the database).

The peers are installed, pinned, into virtualenvs of their own under var/peers/ (`--venvs`; not the
project's .venv), made on the first run and reused. Fairshare's paths run in the project's venv.

Protocol, per system and round: a fresh database (a copy of the system's migrated template
database, made at the start of the run) on DATABASE_URL's server; N jobs enqueued up front, one
call per job (fairshare-many*: one call for all), by a child process in the system's interpreter,
with no worker running (timed: the calls alone; Fairshare sends none of its account work to the
broker then, as no worker could start it: it waits in line, and the workers' pulses and loops take
it once they run); a CHECKPOINT; then the workers start, and the number of jobs not yet finished is
polled every 10 ms. jobs/s = the jobs left at the first poll that saw a job finished, divided by
the time from that poll to the first poll that saw none left (worker start-up is left out).
Machine CPU seconds per 1,000 jobs: /proc/stat's busy time over the same window (every process:
workers, PostgreSQL, this benchmark's polling), as bench/harness.py measures it; beside it the
CPU of the system's own processes over the window (its workers' sessions and its database's
backends, from /proc/<pid>/stat), which other work on a shared machine cannot inflate, and the
write-ahead log the server wrote over the window per job (what the database writes for each job:
the same whatever the load). What each job
leaves: the rows in every table of the database after the workers stopped, minus those before
the enqueue. What the database did for each job, from its own counters (pg_stat_database) from the
workers' start until they stopped, less the benchmark's own polls: transactions (commits and
rollbacks) and row writes (rows inserted, updated and deleted), per job. The 1-minute load
average at each measurement's start is in the table: figures taken on a loaded machine are not
results. Rounds rotate the order of the systems; medians over rounds. With --waits, each poll
also samples what the system's database backends are doing (working, waiting for a row lock another
transaction holds, for the WAL's flush at commit, ...): the shares per round, and the statements
seen waiting for a row lock most, in the log and the JSON.

Goals printed (issues 27, 43): every Fairshare path measured (chain, many, many-wide, tasks,
chain-redis) at or above Procrastinate's jobs/s, with no more machine CPU per job: the summary
names the slowest path and the costliest, not the fastest; (issue 38) the chain on RabbitMQ at
least 0.8x its jobs/s on the ORM broker. Results: a table on stdout, JSON in bench/results/. Not part of .ci/run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

PEER_APPS = h.REPO / "bench" / "peer_apps"
ENQUEUE = PEER_APPS / "enqueue.py"
DEFAULT_VENVS = h.REPO / "var" / "peers"
DB_PREFIX = "fairshare_peers"  # --db-prefix: two runs on one server use different ones
# The paths every goal is about (issue 43): each of them at or above Procrastinate.
GOAL_PATHS = ("fairshare-chain", "fairshare-many", "fairshare-many-wide", "fairshare-tasks", "fairshare-chain-redis")
PSYCOPG = "psycopg[binary]==3.3.9"  # the project's own
PROCRASTINATE_REQUIREMENTS = ("procrastinate==3.10.0", PSYCOPG)
DTDB_REQUIREMENTS = ("Django==5.2.19", "django-tasks==0.12.0", "django-tasks-db==0.13.0", PSYCOPG)
POLL_S = 0.01
# The brokers of the fairshare-chain-redis and -rabbitmq paths: the test suite's servers (scripts/test
# starts them), else the local defaults; the RabbitMQ queues are this run's own, deleted after each round.
REDIS_URL = os.environ.get("FAIRSHARE_TEST_REDIS_URL") or "redis://127.0.0.1:6379/15"
RABBITMQ_URL = os.environ.get("FAIRSHARE_TEST_RABBITMQ_URL") or "amqp://guest:guest@127.0.0.1:5672/%2F"
RABBITMQ_PREFIX = f"fairshare-peers-{os.getpid()}"
BROKER_LABELS = {"redis": "Redis broker", "rabbitmq": "RabbitMQ broker, quorum queue"}
STOP_TIMEOUT_S = 15
INSTALL_TIMEOUT_S = 900
SETUP_TIMEOUT_S = 600


# --- Processes ----------------------------------------------------------------------------------

class Proc:
    """A peer's worker in its own session, logging to `log_path`; stopped like a Fairshare
    cluster (scheduling.processes.Cluster): SIGTERM to its PID, then SIGKILL to its session."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path = PEER_APPS):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        h.at_exit(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)

    def finish(self, deadline: float) -> None:
        if self._log.closed:
            return  # finished before: its session is gone
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()

    def stop(self) -> None:
        self.terminate()
        self.finish(time.monotonic() + STOP_TIMEOUT_S)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def run_child(argv: list[str], env: dict[str, str], *, timeout: float, what: str, cwd: Path = PEER_APPS) -> str:
    """A short-lived command in its own session (killed with its session on a time-out); its stdout."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{err[-3000:]}")
    return out


# --- Virtualenvs of the peers -------------------------------------------------------------------

class Venv:
    """A virtualenv of pinned requirements under `root`, named by their digest, made once."""

    def __init__(self, name: str, requirements: tuple[str, ...], root: Path):
        digest = hashlib.sha256("\n".join(requirements).encode()).hexdigest()[:10]
        self.requirements = requirements
        self.dir = root / f"{name}-{digest}"
        self.marker = self.dir / "installed.txt"  # `pip freeze`, written once the install succeeded

    @property
    def python(self) -> str:
        return str(self.dir / "bin" / "python")

    def bin(self, name: str) -> str:
        return str(self.dir / "bin" / name)

    def ensure(self, *, reinstall: bool = False) -> None:
        if self.marker.exists() and not reinstall:
            return
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.parent.mkdir(parents=True, exist_ok=True)
        h.log(f"installing {' '.join(self.requirements)} into {self.dir}")
        # The project's interpreter (its base Python: `-m venv` from a venv uses that).
        subprocess.run([sys.executable, "-m", "venv", str(self.dir)], check=True, timeout=120)
        subprocess.run([self.python, "-m", "pip", "install", "--disable-pip-version-check", "-q", *self.requirements],
                       check=True, timeout=INSTALL_TIMEOUT_S)
        freeze = subprocess.run([self.python, "-m", "pip", "freeze", "--disable-pip-version-check"], check=True,
                                capture_output=True, text=True, timeout=120).stdout
        self.marker.write_text(freeze)

    def freeze(self) -> list[str]:
        return self.marker.read_text().split()


def peer_env(db_url: str, **extra: str) -> dict[str, str]:
    """A peer's environment: none of the project's settings, only its database and its modules."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR") if k in os.environ}
    env.update(PEERS_DATABASE_URL=db_url, PYTHONPATH=str(PEER_APPS), PYTHONUNBUFFERED="1", **extra)
    return env


# --- One adapter per system ---------------------------------------------------------------------

class System:
    """How the benchmark drives one system. `template` names the migrated database its rounds copy
    (Fairshare's three paths share one); `remaining_sql` counts the jobs not finished yet;
    `check_sql` counts what must be N (or 0, `check_equals_n` False) once the queue is empty."""

    key = label = template = remaining_sql = check_sql = ""
    check_equals_n = True
    workers = ""

    def python(self) -> str:
        raise NotImplementedError

    def install(self, venvs: Path, reinstall: bool) -> None:
        pass

    def versions(self) -> list[str]:
        return []

    def setup(self, db_url: str) -> None:  # migrate the template database
        raise NotImplementedError

    def child_env(self, db_url: str) -> dict[str, str]:
        return peer_env(db_url)

    def enqueue(self, db_url: str, n: int) -> float:
        out = run_child([self.python(), str(ENQUEUE), self.key, str(n)], self.child_env(db_url),
                        timeout=SETUP_TIMEOUT_S, what=f"{self.key}: enqueue")
        return json.loads(out.strip().splitlines()[-1])["seconds"]

    def start(self, db_url: str, log_dir: Path) -> list:
        raise NotImplementedError

    def remaining(self, count, n: int) -> int:
        """Jobs not finished yet (`count` runs a query on the round's database)."""
        return count(self.remaining_sql)

    def cleanup(self) -> None:
        """After a round: anything the system left outside its database."""


class Fairshare(System):
    """Fairshare's paths: the project's venv, one `manage.py qcluster` (2 workers, ORM broker, poll 0.1 s)."""

    template = "fairshare"
    remaining_sql = "SELECT count(*) FROM django_q_ormq WHERE key = 'default'"
    workers = "1 qcluster, 2 workers (ORM broker, poll 0.1 s)"

    def __init__(self, path: str, label: str, leaves: str, broker: str = "orm"):
        self.key, self.label, self.leaves = f"fairshare-{path}", label, leaves
        self.broker = broker
        if broker != "orm":
            self.workers = f"1 qcluster, 2 workers ({BROKER_LABELS[broker]})"
        if path in ("chain", "tenants", "many", "many-wide") or path.startswith("chain-"):
            # What waits in the broker, and in the accounts' lines (no worker free to start it).
            self.remaining_sql = ("SELECT (SELECT count(*) FROM django_q_ormq WHERE key = 'default') + "
                                  "(SELECT count(*) FROM scheduling_deferredtask WHERE ref LIKE 'peers-%')")
        if path == "tasks":  # the calls' refs are their ids
            self.remaining_sql = ("SELECT (SELECT count(*) FROM django_q_ormq WHERE key = 'default') + "
                                  "(SELECT count(*) FROM scheduling_deferredtask WHERE job LIKE 'tasks.%')")
        if path == "bare":  # no record of a success (save_limit -1): no failure recorded either
            self.check_sql, self.check_equals_n = "SELECT count(*) FROM django_q_task WHERE NOT success", False
        elif path == "tasks":
            self.check_sql = "SELECT count(*) FROM tasks_taskcall WHERE status = 'SUCCESSFUL'"
        else:  # the benchmark's runs (refs peers-<i>), not the product's schedules' maintenance jobs
            self.check_sql = "SELECT count(*) FROM scheduling_taskrun WHERE outcome = 'succeeded' AND ref LIKE 'peers-%'"

    def python(self) -> str:
        return sys.executable

    def versions(self) -> list[str]:
        from importlib.metadata import version
        return [f"Django=={version('Django')}", f"django-q2=={version('django-q2')}", f"psycopg=={version('psycopg')}"]

    def broker_env(self) -> dict[str, str]:
        """What points a Fairshare process at this path's broker (the ORM broker: nothing)."""
        if self.broker == "redis":
            return {"REDIS_URL": REDIS_URL}
        if self.broker == "rabbitmq":
            return {"RABBITMQ_URL": RABBITMQ_URL, "FAIRSHARE_RABBITMQ_PREFIX": RABBITMQ_PREFIX}
        return {}

    def child_env(self, db_url: str) -> dict[str, str]:
        # Applied by the enqueue child after its harness set-up (which drops REDIS_URL for the ORM broker).
        return {**os.environ, "PEERS_DATABASE_URL": db_url, "PEERS_FAIRSHARE_BROKER": json.dumps(self.broker_env())}

    def remaining(self, count, n: int) -> int:
        if self.broker == "orm":
            return count(self.remaining_sql)
        # Outside the database, a broker's messages: what is left is what has not succeeded yet
        # (before the workers start, the jobs waiting in line: none is sent then).
        return max(count(self.remaining_sql), n - count(self.check_sql))

    def cleanup(self) -> None:
        if self.broker == "rabbitmq":
            import pika

            connection = pika.BlockingConnection(pika.URLParameters(RABBITMQ_URL))
            channel = connection.channel()
            for queue in ("default", "exports"):
                for name in (f"{RABBITMQ_PREFIX}.{queue}", f"{RABBITMQ_PREFIX}.{queue}.dead",
                             f"{RABBITMQ_PREFIX}.{queue}.later"):
                    channel.queue_delete(name)
            connection.close()

    def setup(self, db_url: str) -> None:  # migrate, and budget_overhead's account
        run_child([self.python(), str(ENQUEUE), "fairshare-setup", "0"], self.child_env(db_url), cwd=h.REPO,
                  timeout=SETUP_TIMEOUT_S, what="fairshare: migrate")

    def start(self, db_url: str, log_dir: Path) -> list:
        env = h.cluster_env(workers=2, poll=0.1, DATABASE_URL=db_url, **self.broker_env())
        return [h.start_cluster(env, log_dir / f"{self.key}.log")]


class Procrastinate(System):
    key, label = "procrastinate", "Procrastinate 3.10 (1 worker, concurrency 2)"
    template = "procrastinate"
    remaining_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')"
    check_sql = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
    workers = "1 `procrastinate worker`, concurrency 2"

    def install(self, venvs: Path, reinstall: bool) -> None:
        self.venv = Venv("procrastinate", PROCRASTINATE_REQUIREMENTS, venvs)
        self.venv.ensure(reinstall=reinstall)

    def python(self) -> str:
        return self.venv.python

    def versions(self) -> list[str]:
        return self.venv.freeze()

    def _cli(self, *args: str) -> list[str]:
        return [self.venv.bin("procrastinate"), "--app=procrastinate_app.app", *args]

    def setup(self, db_url: str) -> None:
        run_child(self._cli("schema", "--apply"), peer_env(db_url), timeout=SETUP_TIMEOUT_S, what="procrastinate schema")

    def start(self, db_url: str, log_dir: Path) -> list:
        return [Proc(self._cli("worker", "--concurrency=2"), peer_env(db_url), log_dir / f"{self.key}.log")]


class DjangoTasksDb(System):
    key, label = "django-tasks-db", "django-tasks 0.12 + django-tasks-db 0.13 (2 db_worker, CONN_MAX_AGE 60)"
    template = "dtdb"
    remaining_sql = "SELECT count(*) FROM django_tasks_database_dbtaskresult WHERE status IN ('READY', 'RUNNING')"
    check_sql = "SELECT count(*) FROM django_tasks_database_dbtaskresult WHERE status = 'SUCCESSFUL'"
    workers = "2 `db_worker` processes (interval 1 s, CONN_MAX_AGE 60)"

    def install(self, venvs: Path, reinstall: bool) -> None:
        self.venv = Venv("django-tasks-db", DTDB_REQUIREMENTS, venvs)
        self.venv.ensure(reinstall=reinstall)

    def python(self) -> str:
        return self.venv.python

    def versions(self) -> list[str]:
        return self.venv.freeze()

    def child_env(self, db_url: str) -> dict[str, str]:
        return peer_env(db_url, DJANGO_SETTINGS_MODULE="dtdb_settings")

    def setup(self, db_url: str) -> None:
        run_child([self.python(), "-m", "django", "migrate", "--noinput", "-v", "0"], self.child_env(db_url),
                  timeout=SETUP_TIMEOUT_S, what="django-tasks-db migrate")

    def start(self, db_url: str, log_dir: Path) -> list:
        return [Proc([self.python(), "-m", "django", "db_worker"], self.child_env(db_url), log_dir / f"{self.key}-{i}.log")
                for i in range(2)]


SYSTEMS = {s.key: s for s in (
    Procrastinate(),
    DjangoTasksDb(),
    Fairshare("bare", "django-q2 1.11 bare, Fairshare's settings", "nothing"),
    Fairshare("recorded", 'Fairshare, TaskRun only ("recorded")', "a TaskRun"),
    Fairshare("chain", "Fairshare, full chain", "a metered TaskRun, slot, ledger charge"),
    Fairshare("tenants", "Fairshare, full chain, jobs of two accounts", "a metered TaskRun, slot, ledger charge"),
    Fairshare("many", "Fairshare, full chain, enqueue_many, cap = workers", "a metered TaskRun, slot, ledger charge"),
    Fairshare("many-wide", "Fairshare, full chain, enqueue_many, cap far above the workers",
              "a metered TaskRun, slot, ledger charge"),
    Fairshare("tasks", "Fairshare, Tasks API (Task.enqueue)", "a TaskCall, a metered TaskRun, slot, ledger charge"),
    Fairshare("chain-redis", "Fairshare, full chain, Redis broker", "a metered TaskRun, slot, ledger charge",
              broker="redis"),
    Fairshare("chain-rabbitmq", "Fairshare, full chain, RabbitMQ broker", "a metered TaskRun, slot, ledger charge",
              broker="rabbitmq"),
)}


# --- Databases ----------------------------------------------------------------------------------

def server_url(name: str) -> str:
    """The URL of database `name` on DATABASE_URL's server (default postgres://postgres@127.0.0.1:5432)."""
    parts = urlsplit(os.environ.get("DATABASE_URL") or h.DEFAULT_SERVER_URL)
    return urlunsplit(parts._replace(path="/" + name, query=""))


def create_database(name: str, *, template: str | None = None) -> str:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_url("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        create = sql.SQL("CREATE DATABASE {} ENCODING 'UTF8' TEMPLATE {}").format(
            sql.Identifier(name), sql.Identifier(template or "template0"))
        for attempt in range(20):  # a template's last client may still be leaving
            try:
                admin.execute(create)
                break
            except psycopg.errors.ObjectInUse:
                if attempt == 19:
                    raise
                time.sleep(0.5)
    return server_url(name)


def drop_database(name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(server_url("postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def table_counts(conn) -> dict[str, int]:
    """Rows of every table in the database's public schema."""
    from psycopg import sql

    tables = [r[0] for r in conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') ORDER BY 1").fetchall()]
    return {t: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(t))).fetchone()[0] for t in tables}


def own_cpu_ticks(procs: list, conn) -> tuple[dict[int, int], set[int]]:
    """CPU clock ticks (user + system, with reaped children's) of every process in the workers'
    sessions and of the database's other backends (not this benchmark's): by PID, from /proc; and
    which of them are the database's backends."""
    sessions = {p.pid for p in procs}
    backends = {r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()}
    ticks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        pid = int(entry.name)
        if int(fields[3]) in sessions or pid in backends:  # fields[3]: its session id
            ticks[pid] = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks, backends


def own_cpu_seconds(start: dict[int, int], end: dict[int, int], only: set[int] | None = None) -> float:
    """The CPU those processes (or the `only` ones) spent between two `own_cpu_ticks` (a process new
    at the end counts whole; one that exited and was not reaped by another of them is lost: a closed
    connection)."""
    return sum(t - start.get(pid, 0) for pid, t in end.items()
               if only is None or pid in only) / os.sysconf("SC_CLK_TCK")


# --- One round of one system --------------------------------------------------------------------

# What the system's database backends were doing, one sample of pg_stat_activity per poll (--waits):
# working (no wait event), waiting for a row another transaction holds (Lock), for the WAL's
# flush at commit (IO), for an internal lock (LWLock), or other.
ACTIVITY_SQL = ("SELECT COALESCE(wait_event_type, 'working'), left(regexp_replace(query, '\\s+', ' ', 'g'), 60) "
                "FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' AND pid <> pg_backend_pid()")


def waits_summary(samples: collections.Counter) -> dict:
    """Shares of the sampled backend states, and the statements seen waiting for a row lock most."""
    total = sum(samples.values()) or 1
    by_kind = collections.Counter()
    for (kind, _), k in samples.items():
        by_kind[kind] += k
    locked = [(query, k) for (kind, query), k in samples.most_common() if kind == "Lock"][:3]
    return {"samples": total, "share": {kind: k / total for kind, k in by_kind.most_common()},
            "lock_waits_by_statement": [{"statement": q, "share": k / total} for q, k in locked]}


# What the database did, from its own counters: transactions ended, rows written.
DATABASE_SQL = ("SELECT xact_commit + xact_rollback, tup_inserted + tup_updated + tup_deleted "
                "FROM pg_stat_database WHERE datname = current_database()")


class Counted:
    """A connection whose statements are counted: each one the benchmark sends in autocommit is a
    transaction of its own in the database's counters, which are the system's less these."""

    def __init__(self, conn):
        self.conn, self.statements = conn, 0

    def execute(self, *args, **kwargs):
        self.statements += 1
        return self.conn.execute(*args, **kwargs)


def database_counters(db_url: str) -> tuple[int, int]:
    """(transactions, row writes) of the database so far, read on a connection of its own once the
    connections before it closed (a backend's counts reach pg_stat_database at the latest when it
    exits; the read's own transaction is one more)."""
    import psycopg

    time.sleep(0.5)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        return conn.execute(DATABASE_SQL).fetchone()


def measure(system: System, n: int, db_name: str, template: str, log_dir: Path, timeout: float,
            waits: bool = False) -> dict:
    import psycopg

    db_url = create_database(db_name, template=template)
    load = os.getloadavg()[0]
    with psycopg.connect(db_url, autocommit=True) as conn:
        count = lambda q: conn.execute(q).fetchone()[0]  # noqa: E731
        before = table_counts(conn)
        enqueue_s = system.enqueue(db_url, n)
        if system.remaining(count, n) != n:
            raise RuntimeError(f"{system.key}: {system.remaining(count, n)} jobs waiting after enqueueing {n}")
        conn.execute("CHECKPOINT")  # no checkpoint of the enqueue's writes in the measured window
    xacts_before, writes_before = database_counters(db_url)
    with psycopg.connect(db_url, autocommit=True) as raw:
        conn = Counted(raw)
        count = lambda q: conn.execute(q).fetchone()[0]  # noqa: E731
        procs = system.start(db_url, log_dir)
        try:
            t_start = time.perf_counter()
            first = None  # (time, jobs left, machine CPU s) at the first poll that saw a job finished
            activity = collections.Counter()
            while True:
                left = system.remaining(count, n)
                if waits and first is not None:
                    activity.update(conn.execute(ACTIVITY_SQL).fetchall())
                now, cpu = time.perf_counter(), h.machine_cpu_seconds()
                if first is None and left < n:
                    first = (now, left, cpu)
                    own_first, _ = own_cpu_ticks(procs, conn)
                    wal_first = count("SELECT pg_current_wal_lsn()")
                if left == 0:
                    wal_bytes = count(f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{wal_first}')")
                    own_last, backends = own_cpu_ticks(procs, conn)
                    own = own_cpu_seconds(own_first, own_last)
                    own_db = own_cpu_seconds(own_first, own_last, only=backends)
                    break
                dead = [p for p in procs if not p.alive()]
                if dead:
                    raise RuntimeError(f"{system.key}: a worker exited ({dead[0].returncode}):\n{dead[0].tail(40)}")
                if now - t_start > timeout:
                    raise TimeoutError(f"{system.key}: {left} of {n} jobs left after {timeout:.0f} s:\n{procs[0].tail(40)}")
                time.sleep(POLL_S)
        finally:
            h.processes.stop_all(procs, STOP_TIMEOUT_S)
            system.cleanup()
        polls = conn.statements
    xacts_after, writes_after = database_counters(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        count = lambda q: conn.execute(q).fetchone()[0]  # noqa: E731
        checked = count(system.check_sql)
        if checked != (n if system.check_equals_n else 0):
            raise RuntimeError(f"{system.key}: check {system.check_sql!r} gave {checked} for {n} jobs:\n{procs[0].tail(40)}")
        after = table_counts(conn)
    drop_database(db_name)
    t_first, left_at_first, cpu_first = first
    seconds = now - t_first
    rows = {t: after.get(t, 0) - before.get(t, 0) for t in sorted(set(after) | set(before))}
    return {
        "jobs": n, "enqueue_s": enqueue_s, "enqueue_per_s": n / enqueue_s,
        "start_to_first_finish_s": t_first - t_start, "jobs_in_window": left_at_first,
        "window_s": seconds, "jobs_per_s": left_at_first / seconds,
        "start_to_empty_s": now - t_start,
        "machine_cpu_s_per_1000": None if cpu is None else (cpu - cpu_first) * 1000 / left_at_first,
        "own_cpu_s_per_1000": own * 1000 / left_at_first,
        "database_cpu_s_per_1000": own_db * 1000 / left_at_first,
        "wal_bytes_per_job": float(wal_bytes) / left_at_first,
        # From the workers' start until they stopped, all N jobs (start-up and pulses included).
        # Less the benchmark's: its polls, and the first counters' read (two statements).
        "transactions_per_job": (xacts_after - xacts_before - polls - 2) / n,
        "row_writes_per_job": (writes_after - writes_before) / n,
        "rows_left": {t: d for t, d in rows.items() if d},
        "loadavg_1m_at_start": load,
        **({"backends": waits_summary(activity)} if waits else {}),
    }


def leaves_text(rows: dict[str, float], n: int) -> str:
    """Rows per job of the tables that gained about one row per job or more; the others' counts
    (rows per run, not per job: a heartbeat per worker, a ledger day) after a semicolon."""
    per_job = ", ".join(f"{t} {d / n:.2g}" for t, d in rows.items() if d >= n / 2) or "nothing"
    other = ", ".join(f"{t} {d:+d}" for t, d in rows.items() if d < n / 2)
    return f"{per_job}; per run: {other}" if other else per_job


# --- Main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Systems: " + ", ".join(SYSTEMS) + ". Not part of .ci/run.")
    p.add_argument("--quick", action="store_true", help="smoke run: 300 jobs per system, 2 rounds")
    p.add_argument("--jobs", type=int, help="jobs per system and round (default 2000; 300 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds, the systems' order rotated each round (default 3; 2 with --quick)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, in the first round's order "
                                                                   "(default: all)")
    p.add_argument("--venvs", type=Path, default=DEFAULT_VENVS, help="where the peers' virtualenvs live (default var/peers)")
    p.add_argument("--reinstall", action="store_true", help="make the peers' virtualenvs again")
    p.add_argument("--timeout", type=float, default=600, help="seconds a drain may take before the run fails")
    p.add_argument("--keep", action="store_true", help="keep the template databases (fairshare_peers_tmpl_*)")
    p.add_argument("--json", type=Path, help="results file (default bench/results/peers[-quick].json)")
    p.add_argument("--db-prefix", default=DB_PREFIX,
                   help=f"names of this run's databases (default {DB_PREFIX}): two runs on one server need two")
    p.add_argument("--waits", action="store_true",
                   help="sample what the system's database backends wait for at each poll (row locks, commits' "
                        "WAL flush): one more query per poll, in the machine CPU figure")
    args = p.parse_args(argv)
    args.jobs = args.jobs or (300 if args.quick else 2000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown systems {unknown}; known: {', '.join(SYSTEMS)}")
    args.json = args.json or h.RESULTS_DIR / ("peers-quick.json" if args.quick else "peers.json")
    return args


def goals_against_procrastinate(summary: dict) -> dict:
    """Every Fairshare path measured (GOAL_PATHS) against Procrastinate: the slowest one's jobs/s and
    the costliest one's CPU per job, each named (one path above it says nothing of the others)."""
    paths = [k for k in GOAL_PATHS if k in summary]
    if not paths or "procrastinate" not in summary:
        return {}
    proc = summary["procrastinate"]
    goals = {}
    slowest = min(paths, key=lambda k: summary[k]["jobs_per_s"])
    goals["jobs_per_s"] = {"goal": f"the slowest Fairshare path ({slowest}) jobs/s >= Procrastinate's",
                           "path": slowest, "value": summary[slowest]["jobs_per_s"] / proc["jobs_per_s"],
                           "pass": summary[slowest]["jobs_per_s"] >= proc["jobs_per_s"]}
    for key, what, extra in (("machine_cpu_s_per_1000", "cpu", "machine CPU per job"),
                             ("own_cpu_s_per_1000", "own_cpu", "its processes' CPU per job, which other work "
                                                               "cannot inflate")):
        measured = [k for k in paths if summary[k][key] is not None]
        if not measured or proc[key] is None:
            continue
        costliest = max(measured, key=lambda k: summary[k][key])
        goals[what] = {"goal": f"the costliest Fairshare path ({costliest}) {extra} <= Procrastinate's",
                       "path": costliest, "value": summary[costliest][key] / proc[key],
                       "pass": summary[costliest][key] <= proc[key]}
    return goals


def main(argv=None) -> int:
    args = parse_args(argv)
    h.install_cleanup()
    # This process's Django (for the qcluster's environment and the machine's figures) on the
    # server's `postgres` database, which it only reads; every system gets databases of its own.
    h.configure_environment(server_url("postgres"), test_jobs=False)
    h.setup_django()
    info = h.machine_info(server_url("postgres"))
    systems = [SYSTEMS[k] for k in args.systems]
    for s in systems:
        s.install(args.venvs, args.reinstall)

    templates = {}
    for s in systems:
        if s.template not in templates:
            name = f"{args.db_prefix}_tmpl_{s.template}"
            h.log(f"template database {name} for {s.key}")
            s.setup(create_database(name))
            templates[s.template] = name
            if not args.keep:
                h.at_exit(lambda name=name: drop_database(name))

    log_dir = Path(tempfile.mkdtemp(prefix="fairshare-peers-"))
    h.at_exit(lambda: shutil.rmtree(log_dir, ignore_errors=True))
    h.log(f"{args.jobs} jobs per system, {args.rounds} rounds; logs in {log_dir}")
    rounds = []
    for r in range(args.rounds):
        k = r % len(systems)
        order = systems[k:] + systems[:k]
        result = {"order": [s.key for s in order]}
        for s in order:
            time.sleep(1.0)  # the previous system's processes gone, its database dropped
            x = measure(s, args.jobs, f"{args.db_prefix}_{s.key.replace('-', '_')}", templates[s.template], log_dir,
                        args.timeout, waits=args.waits)
            result[s.key] = x
            h.log(f"round {r + 1}: {s.key:18s} {x['jobs_per_s']:7.1f} jobs/s, "
                  f"{h.fmt(x['machine_cpu_s_per_1000'], '.2f')} machine / {x['own_cpu_s_per_1000']:.2f} own / "
                  f"{x['database_cpu_s_per_1000']:.2f} database CPU s per 1,000, {x['wal_bytes_per_job']:.0f} WAL bytes/job, "
                  f"{x['transactions_per_job']:.2f} transactions and {x['row_writes_per_job']:.1f} row writes per job "
                  f"(enqueue {x['enqueue_per_s']:.0f}/s, "
                  f"load {x['loadavg_1m_at_start']:.2f})")
            if args.waits:
                b = x["backends"]
                h.log("    its backends: " + ", ".join(f"{kind} {share:.0%}" for kind, share in b["share"].items())
                      + "".join(f"; row locks in {w['statement']!r} {w['share']:.0%}" for w in b["lock_waits_by_statement"]))
        rounds.append(result)

    summary = {}
    for s in systems:
        xs = [r[s.key] for r in rounds]
        cpus = [x["machine_cpu_s_per_1000"] for x in xs if x["machine_cpu_s_per_1000"] is not None]
        summary[s.key] = {
            "label": s.label, "workers": s.workers, "versions": s.versions(),
            "jobs_per_s": h.median([x["jobs_per_s"] for x in xs]),
            "jobs_per_s_rounds": [x["jobs_per_s"] for x in xs],
            "machine_cpu_s_per_1000": h.median(cpus) if cpus else None,
            "own_cpu_s_per_1000": h.median([x["own_cpu_s_per_1000"] for x in xs]),
            "database_cpu_s_per_1000": h.median([x["database_cpu_s_per_1000"] for x in xs]),
            "wal_bytes_per_job": h.median([x["wal_bytes_per_job"] for x in xs]),
            "transactions_per_job": h.median([x["transactions_per_job"] for x in xs]),
            "row_writes_per_job": h.median([x["row_writes_per_job"] for x in xs]),
            "loadavg_1m": h.median([x["loadavg_1m_at_start"] for x in xs]),
            "enqueue_per_s": h.median([x["enqueue_per_s"] for x in xs]),
            "rows_left_per_job": {t: d / args.jobs for t, d in xs[-1]["rows_left"].items()},
            "leaves": leaves_text(xs[-1]["rows_left"], args.jobs),
        }
    goals = goals_against_procrastinate(summary)
    if "fairshare-chain" in summary and "fairshare-chain-rabbitmq" in summary:
        chain, rabbit = summary["fairshare-chain"], summary["fairshare-chain-rabbitmq"]
        goals["rabbitmq_jobs_per_s"] = {"goal": "the full chain on RabbitMQ >= 0.8x its jobs/s on the ORM broker",
                                        "value": rabbit["jobs_per_s"] / chain["jobs_per_s"],
                                        "pass": rabbit["jobs_per_s"] >= 0.8 * chain["jobs_per_s"]}
    info["loadavg_end"] = list(os.getloadavg())
    results = {
        "benchmark": "peers",
        "timestamp": h.utc_timestamp(),
        "parameters": {
            "jobs": args.jobs, "rounds": args.rounds, "quick": args.quick, "systems": args.systems,
            "timing": "jobs left at the first poll (every 10 ms) that saw a job finished / seconds from it to the "
                      "first poll that saw none left; median over rounds",
            "cpu": "machine busy CPU (/proc/stat, all processes) over the same window, per 1,000 jobs",
            "own_cpu": "CPU of the workers' sessions and of the database's backends (not the benchmark's) over the "
                       "same window, per 1,000 jobs (/proc/<pid>/stat): what other work on the machine cannot inflate",
            "database_cpu": "of own_cpu, the database's backends' (the system's workers' sessions are the rest)",
            "wal": "bytes of write-ahead log the server wrote over the same window (pg_current_wal_lsn), per job: "
                   "what the database writes for each, which machine load does not move",
            "enqueue": "N calls, one per job (fairshare-many*: one enqueue_many), before any worker starts, in a child "
                       "process of the system's interpreter",
            "transactions": "transactions ended (commits and rollbacks) and rows inserted, updated and deleted "
                            "(pg_stat_database) from the workers' start until they stopped, less the benchmark's "
                            "own polls, per job (all N)",
            "load": "1-minute load average at each measurement's start: a loaded machine's figures are not results",
            "rows": "rows gained by every table of the system's database between before the enqueue and after the "
                    "workers stopped (last round)",
            "database": "a fresh database per system and round, copied from the system's migrated template",
        },
        "machine": info,
        "systems": summary,
        "rounds": rounds,
        "goals": goals,
    }

    rows = []
    for s in systems:
        x = summary[s.key]
        rows.append([x["label"], h.fmt(x["jobs_per_s"], ".0f"), " / ".join(f"{v:.0f}" for v in x["jobs_per_s_rounds"]),
                     h.fmt(x["machine_cpu_s_per_1000"], ".2f"), h.fmt(x["own_cpu_s_per_1000"], ".2f"),
                     h.fmt(x["database_cpu_s_per_1000"], ".2f"), h.fmt(x["wal_bytes_per_job"], ".0f"),
                     h.fmt(x["transactions_per_job"], ".2f"), h.fmt(x["row_writes_per_job"], ".1f"),
                     h.fmt(x["loadavg_1m"], ".2f"), h.fmt(x["enqueue_per_s"], ".0f"), x["leaves"]])
    print()
    print(h.render_table(["system", "jobs/s (median)", "rounds", "machine CPU s per 1,000 jobs",
                          "its processes' CPU s", "of which its database's", "WAL bytes per job",
                          "transactions per job", "row writes per job", "load (1 min)", "enqueued/s",
                          "what each job leaves (rows per job)"],
                         rows, right={1, 2, 3, 4, 5, 6, 7, 8, 9, 10}))
    print()
    for g in goals.values():
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']:.2f}x")
    h.print_load(results)
    h.write_results(args.json, results)
    return 0


if __name__ == "__main__":
    h.run(main)
