"""Throwaway PostgreSQL, Redis and RabbitMQ servers of a test's or a benchmark's own.

A test or benchmark that restarts a whole database or broker starts a private one
(`PrivatePostgres`, `PrivateRedis`, `PrivateRabbitMQ`: a temporary folder, a free loopback port,
nothing kept once removed) and
restarts and stops that one, by its PID: the machine's shared servers serve other people's work.
Importable before `django.setup()`.
"""
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from scheduling.processes import READY_TIMEOUT_S, ClusterError


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


RABBITMQ_SERVER = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")  # Debian's, without its su-to-rabbitmq wrapper


class PrivateRabbitMQ:
    """A RabbitMQ node of its own (its own node name, AMQP and distribution ports, data and logs in a
    temporary folder, no plugins, none of the machine's configuration). Unlike PrivateRedis it keeps
    its data across `restart()`: durable queues and persistent messages survive, as in production.
    Stopped by its own PID (SIGTERM to the Erlang VM, a clean shutdown), never through epmd or by name."""

    def __init__(self):
        if not RABBITMQ_SERVER.exists():
            raise ClusterError(f"{RABBITMQ_SERVER} is not installed (Debian's rabbitmq-server)")
        self.port, self.dist_port = free_port(), free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="fairshare-rabbitmq-"))
        self.node = f"fairshare-{self.dir.name.rsplit('-', 1)[-1].lower()}@localhost"
        (self.dir / "rabbitmq.conf").write_text(f"listeners.tcp.default = 127.0.0.1:{self.port}\n")
        (self.dir / "enabled_plugins").write_text("[].\n")
        (self.dir / "rabbitmq-env.conf").write_text("")
        self.proc: subprocess.Popen | None = None
        self.start()

    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/%2F"

    def _env(self) -> dict[str, str]:
        return {**os.environ, "RABBITMQ_NODENAME": self.node, "RABBITMQ_NODE_PORT": str(self.port),
                "RABBITMQ_DIST_PORT": str(self.dist_port), "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
                "RABBITMQ_LOG_BASE": str(self.dir / "log"), "RABBITMQ_LOGS": str(self.dir / "node.log"),
                "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
                "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
                "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
                "RABBITMQ_PID_FILE": str(self.dir / "pid")}

    def start(self) -> None:
        self.proc = subprocess.Popen([str(RABBITMQ_SERVER)], cwd=self.dir, env=self._env(), start_new_session=True,
                                     stdout=open(self.dir / "server.out", "ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _answers(self.port, b"AMQP\x00\x00\x09\x01", b"\x01"):  # Connection.Start: up
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(f"rabbitmq-server on port {self.port} did not start:\n"
                                   + (self.dir / "server.out").read_text(errors="replace")[-2000:])
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
            os.kill(int((self.dir / "pid").read_text().strip()), signal.SIGTERM)  # the VM: a clean stop
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def restart(self, *, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
