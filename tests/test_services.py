"""A test that needs a missing service skips on a developer's machine and fails the run under
CI=true, naming the service (tests/services.py). Shown on the real `broker` fixture, in a pytest run
of its own without Redis (nor RabbitMQ)."""
import os
import subprocess
import sys

from tests.conftest import REPO

PROBE = '''
def test_sends_through_each_broker(broker):
    assert broker.name in ("orm", "redis", "rabbitmq")
'''


def run_without_redis(tmp_path, **env: str) -> subprocess.CompletedProcess:
    # The probe's folder borrows the suite's fixtures; it needs no database, so it creates none.
    (tmp_path / "conftest.py").write_text("from tests.conftest import broker, pytest_configure  # noqa: F401\n")
    (tmp_path / "test_probe.py").write_text(PROBE)
    # Not a pytest-xdist worker of this run, either: a run of its own.
    environ = {k: v for k, v in os.environ.items()
               if k not in ("FAIRSHARE_TEST_REDIS_URL", "FAIRSHARE_TEST_RABBITMQ_URL", "CI")
               and not k.startswith("PYTEST_XDIST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(REPO),
         "-p", "no:cacheprovider", "-q", "-rs", str(tmp_path / "test_probe.py")],
        cwd=REPO, env={**environ, **env}, capture_output=True, text=True, timeout=120)


def test_a_missing_service_skips_a_test_and_says_which(tmp_path):
    done = run_without_redis(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed, 2 skipped" in done.stdout and "needs Redis" in done.stdout, done.stdout


def test_under_ci_a_missing_service_fails_the_run_naming_it(tmp_path):
    done = run_without_redis(tmp_path, CI="true")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 passed, 2 errors" in done.stdout, done.stdout  # failed in its fixture: an error
    assert "CI=true and this test needs Redis, which is missing" in done.stdout, done.stdout
