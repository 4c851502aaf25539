"""The usage log's fixtures: events switched on for this test's connection (`usage_on`), a stream
of the test's own on the shared NATS server (`stream`), and a private nats-server a test may stop
and start again (`private_nats`)."""
import os
import shutil
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.db import connection

from tests.services import needs_service
from usage.conf import EVENTS_GUC


@pytest.fixture
def usage_on(settings):
    """Events are written on this test's connection (as on a process with
    FAIRSHARE_USAGE_NATS_URL; in a django_db test the SET ends with its transaction)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET {EVENTS_GUC} = '1'")
    yield
    with connection.cursor() as cursor:
        cursor.execute(f"RESET {EVENTS_GUC}")


# A stream reserves its byte limit on the server (16 GiB by default): a test's needs little.
SMALL = {"USAGE_MAX_BYTES": 64 * 1024 ** 2}


def nats_url() -> str:
    url = os.environ.get("FAIRSHARE_TEST_NATS_URL")
    if not url:
        needs_service("NATS (JetStream)", "set FAIRSHARE_TEST_NATS_URL, or let scripts/test start nats-server -js")
    return url


@pytest.fixture
def stream(settings):
    """A stream and subject prefix of this test's own on the shared server, deleted after it."""
    url = nats_url()
    tag = uuid.uuid4().hex[:10]
    settings.FAIRSHARE = {**settings.FAIRSHARE, "USAGE_NATS_URL": url, "USAGE_STREAM": f"TEST_{tag}",
                          "USAGE_SUBJECT_PREFIX": f"test{tag}.usage", **SMALL}
    yield settings.FAIRSHARE
    delete_stream(url, settings.FAIRSHARE["USAGE_STREAM"])


def delete_stream(url: str, name: str) -> None:
    import asyncio

    from usage.sinks import connect

    async def delete():
        nc = await connect(url)
        try:
            await nc.jetstream().delete_stream(name)
        except Exception:
            pass
        await nc.close()
    try:
        asyncio.run(delete())
    except OSError:
        pass  # the server is gone (a private one a test stopped)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrivateNats:
    """`nats-server -js -p PORT -sd DIR`, started and stopped by its PID; its store survives a stop."""

    port: int
    store: Path
    log_path: Path
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                ["nats-server", "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on {self.port}: {self.log_path.read_text()[-2000:]}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.process = None


@pytest.fixture
def private_nats(tmp_path, settings):
    if shutil.which("nats-server") is None:
        needs_service("nats-server", "install it (Debian: nats-server) so a test can restart a server of its own")
    server = PrivateNats(free_port(), tmp_path / "nats-store", tmp_path / "nats-server.log")
    server.start()
    settings.FAIRSHARE = {**settings.FAIRSHARE, "USAGE_NATS_URL": server.url, **SMALL}
    yield server
    server.kill()
