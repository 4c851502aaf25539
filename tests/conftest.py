"""Shared fixtures. Tests run against PostgreSQL (scripts/test finds or starts one)."""
import time
from pathlib import Path

import pytest
from django.conf import settings

import tests.jobs  # noqa: F401  (registers the test jobs in this process too)
from budgets.models import Role
from scheduling import processes
from scheduling.processes import Cluster
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
    """Environment for a worker process that shares this test's database and export folder, with
    the ORM broker (no REDIS_URL), a fast poll and the test jobs."""
    return processes.worker_env(
        without={"REDIS_URL"},
        DJANGO_SETTINGS_MODULE="config.settings",
        FAIRSHARE_EXPORTS_ROOT=str(export_root),
        FAIRSHARE_POLL="0.1",
        FAIRSHARE_EXTRA_JOB_MODULES="tests.jobs",
        **extra,
    )


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
