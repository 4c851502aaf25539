"""Process control for real `manage.py qcluster` workers: the tests, `bench/` and `rehearse` use it.
(Throwaway PostgreSQL and Redis servers of a test's or a benchmark's own: scheduling.servers.)

A cluster runs in its own session and is stopped by PID, never by name: SIGTERM to its main PID
(graceful: running tasks finish and are recorded), then, after a deadline, SIGKILL to whatever is
left of its session (the workers of a hung cluster).

Importable before `django.setup()` (bench/harness.py imports it first): settings and models are
read when a function runs, not at import.
"""
import contextlib
import datetime as dt
import os
import signal
import subprocess
import sys
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

    def __init__(self, queue: str, env: dict[str, str], log_path: Path, *, command: str = "qcluster"):
        # `command`: another long-running manage.py command started and stopped the same way (the
        # RabbitMQ door's consumer, `door`).
        if queue != "default":
            env = {**env, "Q_CLUSTER_NAME": queue}
        self.queue = queue
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", command], cwd=settings.BASE_DIR, env=env,
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
