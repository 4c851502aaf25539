"""Several hosts: two `qcluster` processes per queue against one database and one Redis broker
(as two worker hosts would run them), one of them SIGKILLed halfway through 50 exports of three
accounts. What users and operators would notice: every export succeeds with one object and one
manifest and one e-mail, the usage ledger is exact, no account ever ran more exports at once than
its cap, and every schedule fired at most once per tick although every cluster runs a scheduler.

At most once (Redis): the killed cluster's fetched messages are gone; the reconciler's schedules
(reclaim-leases, reconcile-exports, every minute) turn them into latency.
"""
import datetime as dt
import os
import signal

import pytest
from django.db.models import Sum
from django.utils import timezone
from django_q.models import Schedule

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, Role, UsageDay
from exports.models import ExportRecord, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling import processes
from scheduling.models import Outcome, TaskRun, WorkerHeartbeat
from scheduling.schedules import SCHEDULES, sync_schedules
from tests.exports.conftest import FAST_RECOVERY
from tests.exports.support import add_events, notification_ids, notifications
from tests.factories import AccountFactory, MembershipFactory, UserFactory
from tests.stores import LocalStore

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

EXPORTS, ROWS, CAP = 50, 200, 2
# A worker host: short leases and a fast pulse (as in the crash tests), two exports workers, and
# the reconciler's "queued too long" short enough to matter within the test.
HOST = {**FAST_RECOVERY, "FAIRSHARE_EXPORT_WORKERS": "2", "FAIRSHARE_WORKERS": "1", "FAIRSHARE_EXPORT_STALE_AFTER": "5"}


def peak_overlap(intervals: list[tuple[dt.datetime, dt.datetime]]) -> int:
    """The most intervals open at one instant (an end before a start at the same instant)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


def _accounts_with_owners(count: int):
    owners = []
    for i in range(count):
        account = AccountFactory(slug=f"tenant{i}")
        Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=1_000_000, max_concurrent=CAP)
        add_events(account, ROWS)
        user = UserFactory(username=f"owner{i}")
        MembershipFactory(account=account, user=user, role=Role.OWNER)
        owners.append((account, user))
    return owners


@pytest.mark.parametrize("broker", ["redis", "rabbitmq"], indirect=True)
def test_two_clusters_per_queue_survive_losing_one_and_keep_budgets_caps_and_schedules(
    broker, export_store: LocalStore, mail_dir, start_cluster,
):
    owners = _accounts_with_owners(3)
    sync_schedules()
    Schedule.objects.update(next_run=timezone.now())  # every schedule due at once: the first tick
    since = timezone.now()
    env = {**HOST, "EMAIL_FILE_PATH": str(mail_dir), **broker.env, **export_store.env}
    host_a = [start_cluster("exports", **env), start_cluster("default", **env)]
    host_b = [start_cluster("exports", **env), start_cluster("default", **env)]
    processes.wait_ready(host_a + host_b, {"exports": 4, "default": 2}, since=since)
    assert WorkerHeartbeat.objects.filter(seen_at__gte=since).values("worker").distinct().count() >= 6

    records = []
    for n in range(EXPORTS):
        account, owner = owners[n % 3]
        # Distinct ranges: 50 different exports (the same range would be the same export).
        record, _ = export_request(account_slug=account.slug, user=owner, start=dt.date(2026, 3, 1),
                                   end=dt.date(2026, 3, 1) + dt.timedelta(days=n // 3 + 14))
        records.append(record)

    def succeeded() -> int:
        return ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED).count()

    _wait(lambda: succeeded() >= EXPORTS // 2, timeout=120, what="half the exports", clusters=host_a + host_b)
    for cluster in host_a:  # host A dies: no graceful stop, its fetched messages are gone
        os.killpg(cluster.pid, signal.SIGKILL)
    _wait(lambda: succeeded() == EXPORTS, timeout=240, what="every export after losing host A", clusters=host_b)
    _wait(lambda: not TaskRun.objects.filter(job=BUILD_JOB, outcome=Outcome.RUNNING).exists()
          and not Reservation.objects.filter(status=ReservationStatus.ACTIVE).exists(),
          timeout=120, what="every run settled or reclaimed", clusters=host_b)
    # django-q2's scheduler first ticks 30 s after a cluster starts: on a fast machine the exports
    # are done before that, so wait for the first tick's runs before stopping.
    _wait(lambda: all(TaskRun.objects.filter(job=spec.job, started_at__gte=since).exists() for spec in SCHEDULES),
          timeout=90, what="the first scheduler tick's runs", clusters=host_b)
    processes.stop_all(host_b)

    copies = {}
    for record in records:
        record.refresh_from_db()
        assert record.status == ExportStatus.SUCCEEDED, (record.pk, record.error_class, record.error_message)
        copies[record.pk] = notifications(mail_dir, record)
        # Every copy carries the export's one Message-ID, which a mail client shows once.
        assert notification_ids(mail_dir, record) == copies[record.pk] >= 1, record.pk
    # Sent once each, but where a worker of host A was SIGKILLed between the mail's acceptance and
    # the commit that marks it sent (exports.notify): the retry sends it again. Each of host A's
    # export workers died once, so at most that many were sent twice.
    assert sum(n - 1 for n in copies.values()) <= int(HOST["FAIRSHARE_EXPORT_WORKERS"]), copies
    keys = sorted(r.output_key for r in records)
    assert export_store.files() == sorted(keys + [k + ".manifest.json" for k in keys])

    day = clock.budget_day()
    for account, _ in owners:
        runs = TaskRun.objects.filter(account=account, job=BUILD_JOB).exclude(outcome=Outcome.DEFERRED)
        # The ledger is exact: what the runs recorded (a killed run: what it had reported) is
        # what the account was charged.
        ledger = UsageDay.objects.get(account=account, queue="exports", day=day)
        assert ledger.cpu_used_ms == runs.aggregate(cpu=Sum("cpu_ms"))["cpu"]
        assert ledger.cpu_reserved_ms == 0
        intervals = [(r.started_at, r.finished_at) for r in runs]
        assert all(end is not None for _, end in intervals)
        assert peak_overlap(intervals) <= CAP, account.slug

    # Every cluster runs a scheduler: still each schedule fired at most once per tick (minute).
    fired = {}
    for spec in SCHEDULES:
        runs = list(TaskRun.objects.filter(job=spec.job, started_at__gte=since).values_list(
            "started_at", "outcome", "worker", "ref"))
        starts = [started for started, *_ in runs]
        fired[spec.job] = len(starts)
        assert len({s.replace(second=0, microsecond=0) for s in starts}) == len(starts), (spec.job, runs)
    assert all(fired.values()), fired  # ...and each fired (the first tick at least)


def _wait(predicate, *, timeout: float, what: str, clusters):
    from tests.budgets.test_processes import wait

    return wait(predicate, timeout=timeout, what=what, clusters=clusters, interval=0.5)
