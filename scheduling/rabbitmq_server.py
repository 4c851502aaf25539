"""A RabbitMQ node of a test's own, which it can restart (tests/exports/test_rabbitmq_restart.py).
Importable before `django.setup()`, as scheduling.servers."""
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from scheduling.processes import READY_TIMEOUT_S, ClusterError
from scheduling.servers import _answers, free_port

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
