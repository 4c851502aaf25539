"""Process control for real `manage.py qcluster` workers, and for throwaway PostgreSQL and Redis
servers of a test's or a benchmark's own: the tests, `bench/` and `rehearse` use it.

A cluster runs in its own session and is stopped by PID, never by name: SIGTERM to its main PID
(graceful: running tasks finish and are recorded), then, after a deadline, SIGKILL to whatever is
left of its session (the workers of a hung cluster).

A test or benchmark that restarts a whole database or Redis server starts a private one
(`PrivatePostgres`, `PrivateRedis`: a temporary folder, a free loopback port, nothing kept) and
restarts and stops that one, by its PID: the machine's shared servers serve other people's work.

Importable before `django.setup()` (bench/harness.py imports it first): settings and models are
read when a function runs, not at import.
"""
import contextlib
import datetime as dt
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import quote

from django.conf import settings
from django.db import connection

STOP_TIMEOUT_S = 15
READY_TIMEOUT_S = 90
POLL_S = 0.5


class ClusterError(Exception):
    """A cluster exited, or was not ready in time; the message ends with the tail of its log."""


def database_url() -> str:
    """The URL of the database this process uses (also under pytest), for worker processes.

    Credentials and the database name are quoted: a password with `@`, `/` or `:` stays one.
    """
    db = connection.settings_dict
    auth = quote(db["USER"] or "", safe="")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"], safe="")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{quote(db['NAME'], safe='')}"


def worker_env(*, without: Iterable[str] = (), **overrides: str) -> dict[str, str]:
    """This process's environment for a worker that shares its database, secret key and settings.

    `without`: variables not to inherit (the tests drop REDIS_URL so workers use the ORM broker
    in the test database). Q_CLUSTER_NAME is never inherited: `Cluster` sets it per queue.
    """
    dropped = {"Q_CLUSTER_NAME", *without}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(
        DJANGO_SETTINGS_MODULE=os.environ.get("DJANGO_SETTINGS_MODULE", "config.settings"),
        SECRET_KEY=settings.SECRET_KEY,
        DATABASE_URL=database_url(),
        PYTHONUNBUFFERED="1",
    )
    env.update(overrides)
    return env


class Cluster:
    """A `manage.py qcluster` of one queue in its own session, logging to `log_path`."""

    def __init__(self, queue: str, env: dict[str, str], log_path: Path):
        if queue != "default":
            env = {**env, "Q_CLUSTER_NAME": queue}
        self.queue = queue
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"], cwd=settings.BASE_DIR, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop it and close its log; safe to call again."""
        self.terminate()
        self.finish(time.monotonic() + timeout)

    def terminate(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)  # graceful: the main PID only

    def finish(self, deadline: float) -> None:
        """Wait for the main PID until `deadline` (time.monotonic()), then kill what is left."""
        if self._log.closed:
            return  # finished before: its session is gone, and the PID may be another's by now
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.1, deadline - time.monotonic()))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of its session
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


class Supervisor:
    """What systemd's `Restart=always` (or a Kubernetes Deployment) does for one cluster, in a test or
    a benchmark: a thread starts it again `restart_s` after it exits, whatever the exit, and keeps
    every exit's code (`exits`; negative: killed by that signal). `stop()` ends the thread, then the
    cluster, by PID."""

    def __init__(self, start: Callable[[], Cluster], *, restart_s: float = 1.0):
        self._start, self._restart_s = start, restart_s
        self.cluster = start()
        self.exits: list[int] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            if self.cluster.alive():
                continue
            self.exits.append(self.cluster.returncode)
            self.cluster.finish(time.monotonic())  # what is left of its session, and its log
            if self._stopping.wait(self._restart_s):
                return
            self.cluster = self._start()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        self._stopping.set()
        self._thread.join()
        self.cluster.stop(timeout)


def stop_all(clusters: Iterable[Cluster], timeout: float = STOP_TIMEOUT_S) -> None:
    """Stop several clusters at once: all are signalled before any is waited for."""
    clusters = list(clusters)
    for cluster in clusters:
        cluster.terminate()
    deadline = time.monotonic() + timeout
    for cluster in clusters:
        cluster.finish(deadline)


def wait_ready(clusters: Iterable[Cluster], wanted: dict[str, int], *, since: dt.datetime,
               timeout: float = READY_TIMEOUT_S) -> None:
    """Until `wanted[queue]` worker processes of each queue have written a heartbeat since
    `since` (a worker writes its first at spawn). Raises ClusterError if a cluster exits first."""
    from scheduling.models import WorkerHeartbeat  # see the module docstring

    clusters = list(clusters)
    deadline = time.monotonic() + timeout
    while True:
        beats = dict.fromkeys(wanted, 0)
        for queue in WorkerHeartbeat.objects.filter(seen_at__gte=since).values_list("queue", flat=True):
            if queue in beats:
                beats[queue] += 1
        if all(beats[q] >= n for q, n in wanted.items()):
            return
        dead = [c for c in clusters if not c.alive()]
        if dead or time.monotonic() > deadline:
            why = "exited" if dead else f"not ready after {timeout:.0f} s ({beats} of {wanted})"
            raise ClusterError(f"worker cluster {why}:\n" + "\n".join(c.tail() for c in dead or clusters))
        time.sleep(POLL_S)


# --- Throwaway servers --------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers(port: int, probe: bytes = b"", expect: bytes = b"") -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            if probe:
                sock.sendall(probe)
                return sock.recv(64).startswith(expect)
            return True
    except OSError:
        return False


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (initdb, pg_ctl), or None when not installed."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)) \
        if Path("/usr/lib/postgresql").is_dir() else []
    pg_ctl = found[-1] if found else shutil.which("pg_ctl")
    return Path(pg_ctl).parent if pg_ctl and (Path(pg_ctl).parent / "initdb").exists() else None


class PrivatePostgres:
    """A PostgreSQL server of its own: `initdb` in a temporary folder, `pg_ctl` on a free port, no
    fsync, trust authentication on loopback. As root it runs as the `postgres` user (initdb refuses
    root). `restart()` is a fast shutdown and a start: every session is cut, as in a real restart."""

    def __init__(self, *, port: int | None = None):
        self.bin = postgres_bin()
        if self.bin is None:
            raise ClusterError("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fairshare-pg-"))
        self.data, self.log_path = self.dir / "data", self.dir / "server.log"
        self._as = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.dir, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        self.start()

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        subprocess.run([*self._as, str(self.bin / program), *args], check=True, timeout=timeout,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def pid(self) -> int | None:
        """The postmaster's PID (first line of postmaster.pid), None while it is down."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        pid = self.pid
        with contextlib.suppress(subprocess.SubprocessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        if pid and self.pid == pid:  # pg_ctl could not stop it: its PID, by hand
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def restart(self, *, down_s: float = 0.0) -> None:
        self.stop("fast")
        time.sleep(down_s)
        self.start()

    def remove(self) -> None:
        """Stop it (immediately: nothing it holds is kept) and delete its folder."""
        self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


class PrivateRedis:
    """A redis-server of its own on a free port, keeping nothing (no RDB, no AOF): `restart()` loses
    every message in it, as the restart of a Redis without persistence does."""

    def __init__(self, *, port: int | None = None):
        self.program = shutil.which("redis-server")
        if self.program is None:
            raise ClusterError("redis-server is not installed")
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fairshare-redis-"))
        self.proc: subprocess.Popen | None = None
        self.start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc and self.proc.poll() is None else None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.program, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _answers(self.port, b"PING\r\n", b"+PONG"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()  # SIGKILL: nothing to save
            self.proc.wait(10)

    def restart(self, *, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
