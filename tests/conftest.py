"""Shared fixtures. Tests run against PostgreSQL (scripts/test finds or starts one)."""
import datetime as dt
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
import redis
from django.conf import settings
from django.core.checks import run_checks
from django.db import connection
from django.utils import timezone
from django_q.conf import Conf

import tests.jobs  # noqa: F401  (registers the test jobs in this process too)
from budgets.models import Queue, Role
from scheduling import processes
from scheduling.models import WorkerHeartbeat
from scheduling.processes import Cluster
from scheduling.testing import FAULT, FAULT_MARKER, FAULT_RESUME
from tests import stores
from tests.factories import AccountFactory, MembershipFactory, UserFactory
from tests.services import needs_service
from tests.stores import LocalStore

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    engine = settings.DATABASES["default"]["ENGINE"]
    if engine != "django.db.backends.postgresql":
        pytest.exit(
            "Fairshare's tests run against PostgreSQL: set DATABASE_URL=postgres://… "
            f"(got {engine}); scripts/test finds or starts a local server for you.",
            returncode=2,
        )
    # The tests speak plain HTTP on loopback (Django's test client, the live server of the browser
    # test), so the HTTPS settings that are on by default without DEBUG are off here, said once:
    # with SECURE_SSL_REDIRECT every request would get a 301 to https://, and with secure cookies
    # a logged-in session would never come back over http. tests/test_settings.py checks the
    # production defaults in a process of their own.
    settings.SECURE_SSL_REDIRECT = False
    settings.SECURE_HSTS_SECONDS = 0
    settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = settings.SECURE_HSTS_PRELOAD = False
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = False


def pytest_collection_modifyitems(config, items):
    """The tests that start processes first: under pytest-xdist (scripts/test) the slowest of them then
    run while the quick ones fill the other worker, instead of one of them ending the run alone."""
    items.sort(key=lambda item: not _starts_processes(item))  # stable: the files' order otherwise


def _starts_processes(item) -> bool:
    return item.get_closest_marker("processes") is not None or "start_cluster" in getattr(item, "fixturenames", ())


def redis_test_url() -> str | None:
    """FAIRSHARE_TEST_REDIS_URL, with a database of this pytest-xdist worker's own (gw0 the URL's,
    gw1 the one below it, ...): the Redis broker's tests empty their database, so tests running side
    by side on two workers must not share one."""
    url = os.environ.get("FAIRSHARE_TEST_REDIS_URL")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    if not url or worker == "gw0":
        return url
    base, _, db = url.rpartition("/")
    return f"{base}/{(int(db or 0) - int(worker.removeprefix('gw'))) % 16}"


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
def midday(settings):
    """The kernel's clock (scheduling.clock) at noon of its budget day: what a test writes for
    "today" is still today when it reads it back, though the run crosses the day's end (00:00 UTC)."""
    from budgets import clock as budget_clock
    from scheduling import clock

    now = clock.now()
    noon = dt.datetime.combine(budget_clock.budget_day(now), dt.time(12), tzinfo=budget_clock.next_reset(now).tzinfo)
    settings.FAIRSHARE = {**settings.FAIRSHARE,
                          "CLOCK_OFFSET_S": settings.FAIRSHARE["CLOCK_OFFSET_S"] + int((noon - now).total_seconds())}
    return noon


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
    the ORM broker (no REDIS_URL nor RABBITMQ_URL), a fast poll and the test jobs."""
    return processes.worker_env(without={"REDIS_URL", "RABBITMQ_URL"}, **{
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "FAIRSHARE_EXPORTS_ROOT": str(export_root),
        "FAIRSHARE_POLL": "0.1",
        "FAIRSHARE_EXTRA_JOB_MODULES": "tests.jobs",  # a test may name more (the demo's: exports.demo)
        # Said, not inherited: a test's worker may arm test-only seams (scheduling/testing.py).
        "FAIRSHARE_TESTING": "1",
        **extra,
    })


# How many workers `beating_workers` says run by default: more than any test's jobs in flight.
BEATING_WORKERS = 64


@pytest.fixture
def beating_workers(django_db_blocker):
    """Workers of a queue that beat (their heartbeats written now, as each worker's pulse writes
    its own), for a test of the enqueue without real workers: work goes to the broker only as far
    as the queue's running workers could start it (budgets.ledger.idle_workers), and without
    heartbeats none could. By default BEATING_WORKERS on each queue; `beating_workers(n, queue=)`
    says how many run on one queue (0: none)."""

    def beat(n: int, *, queue: str = "default") -> None:
        with django_db_blocker.unblock():
            WorkerHeartbeat.objects.filter(queue=queue, worker__startswith="beating:").delete()
            WorkerHeartbeat.objects.bulk_create([WorkerHeartbeat(worker=f"beating:{queue}:{i}", queue=queue,
                                                                 seen_at=timezone.now()) for i in range(n)])

    for queue in Queue.values:
        beat(BEATING_WORKERS, queue=queue)
    return beat


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


def fairshare_checks() -> list[tuple[str, str]]:
    """(id, message) of each problem the Fairshare system checks find in the current settings."""
    return [(message.id, message.msg) for message in run_checks(tags=["fairshare"])]


@dataclass(frozen=True)
class Broker:
    name: str
    # What a worker started for the test needs in its environment to use the same broker.
    env: dict[str, str] = field(default_factory=dict)


@pytest.fixture(params=["orm", "redis", "rabbitmq"])
def broker(request, monkeypatch, settings):
    """Each django-q2 broker Fairshare supports: the ORM broker (at least once), Redis (at most
    once) and RabbitMQ (durable, acknowledged). The test process sends through it, and workers
    started with `broker.env` use it too."""
    if request.param == "orm":
        yield Broker("orm")
        return
    if request.param == "rabbitmq":
        yield from rabbitmq_broker(monkeypatch, settings)
        return
    url = redis_test_url()
    if not url:
        needs_service("Redis", "set FAIRSHARE_TEST_REDIS_URL (scripts/test installs and starts a local one)")
    client = redis.from_url(url)
    client.flushdb()
    # django-q2 reads its broker from Conf at every get_broker(): point this process at Redis.
    monkeypatch.setattr(Conf, "BROKER_CLASS", None)
    monkeypatch.setattr(Conf, "ORM", None)
    monkeypatch.setattr(Conf, "REDIS", url)
    yield Broker("redis", {"REDIS_URL": url})
    client.flushdb()


def rabbitmq_broker(monkeypatch, settings, url: str | None = None):
    """The RabbitMQ broker on `url` (default FAIRSHARE_TEST_RABBITMQ_URL), with queues of this
    test's own (a random prefix), deleted afterwards: tests running side by side on one server never
    share a queue."""
    url = url or os.environ.get("FAIRSHARE_TEST_RABBITMQ_URL")
    if not url:
        needs_service("RabbitMQ", "set FAIRSHARE_TEST_RABBITMQ_URL (scripts/test starts a local server)")
    from scheduling import amqp
    from scheduling.rabbitmq import RabbitMQ

    prefix = f"fstest-{uuid.uuid4().hex[:10]}"
    monkeypatch.setattr(Conf, "BROKER_CLASS", "scheduling.rabbitmq.RabbitMQ")
    monkeypatch.setattr(Conf, "ORM", None)
    monkeypatch.setattr(Conf, "REDIS", None)
    settings.RABBITMQ_URL = url
    settings.FAIRSHARE = {**settings.FAIRSHARE, "RABBITMQ_PREFIX": prefix}
    yield Broker("rabbitmq", {"RABBITMQ_URL": url, "FAIRSHARE_RABBITMQ_PREFIX": prefix})
    for queue in Queue.values:
        RabbitMQ(queue).delete_queue()
    amqp.Publisher.get().close()


@pytest.fixture
def rabbitmq(monkeypatch, settings):
    """Only the RabbitMQ broker (see `broker`)."""
    yield from rabbitmq_broker(monkeypatch, settings)


@pytest.fixture
def export_store(request, export_root, settings, monkeypatch):
    """Where this test's exports go: local files (default), or with
    `@pytest.mark.parametrize("export_store", ["local", "s3"], indirect=True)` also a bucket on the
    real S3 server scripts/test starts. Start workers with `export_store.env`."""
    if getattr(request, "param", "local") == "local":
        return LocalStore(export_root)
    endpoint = stores.s3_endpoint()
    if not endpoint:
        needs_service("an S3 server", f"set {stores.S3_ENDPOINT_ENV} (scripts/test starts moto's)")
    store = stores.S3Store(endpoint)
    for name, value in stores.S3_CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    settings.STORAGES = {**settings.STORAGES, "exports": store.storage}
    return store


@dataclass(frozen=True)
class Pause:
    """A fault point armed to pause (scheduling/faults.py): the first worker to reach it stands
    there until the test resumes it, so a test acts mid-run however fast the machine is."""
    marker: Path
    resume_file: Path
    env: dict

    def reached(self) -> bool:
        return self.marker.exists()

    def resume(self) -> None:
        self.resume_file.touch()


def pause_at(point: str, tmp_path: Path) -> Pause:
    marker, resume_file = tmp_path / f"paused-at-{point}", tmp_path / f"resume-{point}"
    return Pause(marker, resume_file, {FAULT.env: point, FAULT_MARKER.env: str(marker), FAULT_RESUME.env: str(resume_file)})


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


def connect_outside_django() -> psycopg.Connection:
    """A connection of the test's own, outside Django's (not autocommit), to play another session:
    a slow transaction, a concurrent admission."""
    db = settings.DATABASES["default"]
    return psycopg.connect(dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"] or None,
                           host=db["HOST"] or None, port=db["PORT"] or None, autocommit=False)


def backend_waiting_for(other: psycopg.Connection, query_like: str) -> int | None:
    """The server pid of a session blocked on a lock, running a query like `query_like` (not
    `other`'s own). Asked on Django's connection: `other`'s transaction would see one unchanging
    view of pg_stat_activity."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE %s AND pid <> %s",
            [query_like, other.info.backend_pid],
        )
        row = cursor.fetchone()
    return row[0] if row else None
