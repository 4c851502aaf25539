"""Shared fixtures. Tests run against PostgreSQL (scripts/test finds or starts one)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

import tests.jobs  # noqa: F401  (registers the test jobs in this process too)
from budgets.models import Role
from tests.factories import AccountFactory, MembershipFactory, UserFactory

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    engine = settings.DATABASES["default"]["ENGINE"]
    if engine != "django.db.backends.postgresql":
        pytest.exit(
            "Fairshare's tests run against PostgreSQL: set DATABASE_URL=postgres://… "
            f"(got {engine}); scripts/test finds or starts a local server for you.",
            returncode=2,
        )


@pytest.fixture(autouse=True)
def export_root(tmp_path, settings):
    """Each test publishes exports into its own folder (shared with any worker it starts)."""
    root = tmp_path / "exports"
    root.mkdir()
    settings.STORAGES = {
        **settings.STORAGES,
        "exports": {**settings.STORAGES["exports"],
                    "OPTIONS": {**settings.STORAGES["exports"]["OPTIONS"], "location": str(root)}},
    }
    return root


@pytest.fixture
def account():
    return AccountFactory(slug="acme")


@pytest.fixture
def other_account():
    return AccountFactory(slug="globex")


@pytest.fixture
def owner(account):
    return MembershipFactory(account=account, user=UserFactory(username="acme-owner"), role=Role.OWNER).user


@pytest.fixture
def viewer(account):
    return MembershipFactory(account=account, user=UserFactory(username="acme-viewer"), role=Role.VIEWER).user


@pytest.fixture
def outsider(other_account):
    return MembershipFactory(account=other_account, user=UserFactory(username="globex-owner"), role=Role.OWNER).user


def worker_env(export_root: Path, **extra: str) -> dict[str, str]:
    """Environment for a worker process that shares this test's database and export folder."""
    db = connection.settings_dict
    env = {k: v for k, v in os.environ.items() if k not in {"REDIS_URL", "Q_CLUSTER_NAME"}}
    env.update(
        DJANGO_SETTINGS_MODULE="config.settings",
        SECRET_KEY=settings.SECRET_KEY,
        DATABASE_URL=f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        FAIRSHARE_EXPORTS_ROOT=str(export_root),
        FAIRSHARE_POLL="0.1",
        FAIRSHARE_EXTRA_JOB_MODULES="tests.jobs",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


class Cluster:
    """A real `manage.py qcluster` process, stopped by PID (never by process group)."""

    def __init__(self, queue: str, env: dict[str, str], log_path: Path):
        if queue != "default":
            env = {**env, "Q_CLUSTER_NAME": queue}
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "manage.py", "qcluster"], cwd=REPO, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 15) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: the main PID only
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of its session (workers of a hung cluster) is killed outright.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self._log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture
def start_cluster(tmp_path, export_root):
    clusters: list[Cluster] = []

    def start(queue: str = "default", **env_extra: str) -> Cluster:
        cluster = Cluster(queue, worker_env(export_root, **env_extra), tmp_path / f"qcluster-{queue}-{len(clusters)}.log")
        clusters.append(cluster)
        return cluster

    yield start
    for cluster in clusters:
        cluster.stop()


def wait_for(predicate, *, timeout: float, interval: float = 0.1, message: str = "condition"):
    """Poll until predicate() is truthy; fail the test with `message` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)
