"""Whole-server faults: the PostgreSQL server restarted under running exports (on the ORM broker, the
queue itself goes down with it), and the Redis server restarted with every message in it lost (on
the Redis broker). Every export still succeeds once, with one object, one notice, the right bytes,
an exact ledger and no account over its cap.

Each runs the project's kill loop (bench/chaos.py) with that one blow, in a process of its own, on
servers of its own (scheduling.servers PrivatePostgres, PrivateRedis): the machine's shared
PostgreSQL and Redis serve other people's work and are never restarted.
"""
import json
import shutil
import subprocess
import sys

import pytest

from scheduling.servers import postgres_bin
from tests.conftest import REPO
from tests.services import needs_service

pytestmark = pytest.mark.processes

# Four exports over 30 s, a restart every 5-8 s: three or four restarts while exports run.
SHORT = ["--exports", "4", "--duration", "30", "--blow-interval", "5,8", "--rows", "1000", "--drain-timeout", "180"]


def kill_loop(tmp_path, *args: str) -> dict:
    results = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "bench/chaos.py", *SHORT, *args, "--json", str(results)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert results.exists(), done.stdout + done.stderr[-5000:]
    found = json.loads(results.read_text())
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    return found


def assert_every_export_once(found: dict) -> None:
    checks = found["checks"]
    assert checks["succeeded"] == checks["one_object_each"] == checks["bytes_match"] == checks["one_notice_each"] \
        == checks["exports"] == 4, checks
    assert checks["ledger_cpu_ms"] == checks["recorded_cpu_ms"] and checks["reserved_ms_left"] == 0, checks
    assert checks["slots_left"] == 0 and checks["cap_exceeded_by"] == {}, checks


def test_exports_survive_postgresql_restarts(tmp_path):
    if postgres_bin() is None:
        needs_service("PostgreSQL's server programs (initdb, pg_ctl)", "install Debian's postgresql")
    found = kill_loop(tmp_path, "--broker", "orm", "--blows", "restart_postgres")
    assert found["counts"]["restart_postgres"] >= 2, found["counts"]
    assert_every_export_once(found)


def test_exports_survive_redis_restarts_that_lose_every_message(tmp_path):
    if shutil.which("redis-server") is None:
        needs_service("redis-server", "install Debian's redis-server (scripts/test does as root)")
    found = kill_loop(tmp_path, "--broker", "redis", "--blows", "restart_redis")
    assert found["counts"]["restart_redis"] >= 2, found["counts"]
    assert_every_export_once(found)
