"""The zero-setup demo (`scripts/demo --smoke`) works on SQLite and leaves nothing running."""
import contextlib
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.processes

TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def demo_env(var_dir: Path, port: int) -> dict[str, str]:
    # Nothing from the test run may leak in: no PostgreSQL, no Redis, no cluster name, no
    # Fairshare settings other than the ones a user of the demo would set.
    env = {
        k: v for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "Q_CLUSTER_NAME", "DJANGO_SETTINGS_MODULE"}
        and not k.startswith("FAIRSHARE_")
    }
    # The demo runs on this test's Python, and so on its Django line (scripts/test runs the smoke on
    # both): this venv's python, which scripts/lib.sh ensure_venv maps back to this venv.
    env.update(FAIRSHARE_VAR_DIR=str(var_dir), PORT=str(port), DEMO_ROWS="300", FAIRSHARE_PYTHON=sys.executable)
    return env


def demo_processes(var_dir: Path, port: int) -> list[str]:
    """Processes the demo started that are still alive: its web server (its port is on the
    command line) and its qclusters (found by the var dir in their environment)."""
    found = []
    pids = subprocess.run(["pgrep", "-f", "manage.py"], capture_output=True, text=True).stdout.split()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if f"127.0.0.1:{port}" in cmdline or f"FAIRSHARE_VAR_DIR={var_dir}".encode() in environ:
            found.append(f"{pid} {cmdline}")
    return found


def run_demo_smoke(var_dir: Path, port: int) -> tuple[int, str]:
    proc = subprocess.Popen(
        ["bash", "scripts/demo", "--smoke"], cwd=REPO, env=demo_env(var_dir, port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # TERM the script itself: its trap stops what it started, one PID at a time.
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        pytest.fail(f"scripts/demo --smoke did not finish within {TIMEOUT_S}s:\n{output}")
    return proc.returncode, output


def test_demo_smoke_runs_an_export_on_sqlite_shows_how_to_log_in_and_stops_everything(tmp_path):
    var_dir = tmp_path / "var"
    port = free_port()

    returncode, output = run_demo_smoke(var_dir, port)

    assert returncode == 0, output
    # Its first line says which Python (and so which Django line) it runs.
    assert output.splitlines()[0].startswith(f"[fairshare] Python {platform.python_version()} "), output
    assert f"http://127.0.0.1:{port}/admin/" in output
    assert "Login:  admin / fairshare-demo" in output
    assert "smoke: OK" in output
    # The export ran end to end through the demo's own exports cluster.
    export = json.loads(re.search(r"^\{\n.*?^\}$", output, re.S | re.M).group(0))
    assert export["status"] == "succeeded" and export["account"] == "acme"
    assert export["row_count"] > 0
    # On SQLite, in the var dir it was given.
    assert "database: SQLite under" in output
    assert (var_dir / "fairshare.sqlite3").exists()
    # The holding area's counts (Backlog) are kept by triggers on SQLite too: no migration dropped
    # them (one that alters a DeferredTask column rebuilds its table on SQLite, without them).
    import sqlite3

    with contextlib.closing(sqlite3.connect(var_dir / "fairshare.sqlite3")) as db:
        triggers = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger' "
                              "AND tbl_name = 'scheduling_deferredtask'").fetchone()[0]
    assert triggers > 0

    # Nothing it started is left running.
    deadline = time.monotonic() + 15
    while (left := demo_processes(var_dir, port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []
