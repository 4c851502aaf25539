"""A private RabbitMQ node restarted with 200 exports queued and 2 running: every export runs, none
twice in effect (one object, one notice each, an exact ledger), and without waiting for the
reconciler - the queued messages are on disk and the two whose acknowledgements died with the
connection are delivered again. The time from the restart to the last export is printed against
the reconciler's interval.

The machine's shared RabbitMQ is never restarted: the node is the test's own (scheduling.servers).
"""
import time

import pytest
from django.conf import settings as django_settings
from django.db.models import Sum
from django_q.brokers import get_broker

from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from exports.models import ExportRecord, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.models import DeadLetter, DeferredTask, Outcome, TaskRun
from scheduling.processes import ClusterError
from scheduling.runtime import send
from scheduling.rabbitmq_server import RABBITMQ_SERVER, PrivateRabbitMQ
from tests.conftest import rabbitmq_broker
from tests.exports.support import RANGE, add_events, notifications, stored_files, wait_logged
from tests.services import needs_service

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

QUEUED, RUNNING = 200, 2
RECONCILER_CRON_S = 60  # scheduling/schedules.py: reconcile-exports runs "* * * * *"


@pytest.fixture
def private_rabbitmq(monkeypatch, settings):
    if not RABBITMQ_SERVER.exists():
        needs_service("RabbitMQ's server", "install Debian's rabbitmq-server")
    try:
        node = PrivateRabbitMQ()
    except ClusterError as exc:
        needs_service("a private RabbitMQ node", str(exc))
    broker = rabbitmq_broker(monkeypatch, settings, node.url())
    try:
        yield node, next(broker)
    finally:
        for _ in broker:  # its teardown: this test's queues
            pass
        node.remove()


def test_a_restart_with_200_queued_and_2_running_loses_nothing_and_needs_no_reconciler(
    private_rabbitmq, account, owner, export_root, mail_dir, start_exports, tmp_path,
):
    node, broker = private_rabbitmq
    add_events(account, 100)  # two batches of 50: "mid_stream" is between them
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=1_000_000, max_concurrent=1000)
    # The doorbells go straight to RabbitMQ (the enqueue gates would keep all but a pool's worth in
    # the holding area, in the database: here the broker itself must keep them through the restart).
    records = [export_request(account_slug="acme", user=owner, enqueue=False, **RANGE)[0]
               for _ in range(QUEUED + RUNNING)]
    for record in records:
        send(job=BUILD_JOB, account=account.pk, ref=str(record.pk))
    assert get_broker("exports").queue_size() == QUEUED + RUNNING

    # Every export stops mid-stream until `resume` exists: the pool's two workers each hold one.
    resume = tmp_path / "resume"
    cluster = start_exports(FAIRSHARE_EXPORT_WORKERS=str(RUNNING), FAIRSHARE_FAULT="mid_stream",
                            FAIRSHARE_FAULT_RESUME=str(resume), **broker.env)
    wait_logged(cluster, lambda: TaskRun.objects.filter(job=BUILD_JOB, outcome=Outcome.RUNNING).count() == RUNNING,
                timeout=90, message="two exports running")

    restarted_at = time.monotonic()
    node.restart()
    resume.touch()  # the two running exports go on; their acknowledgements' connection is gone
    wait_logged(cluster, lambda: not ExportRecord.objects.exclude(status=ExportStatus.SUCCEEDED).exists(),
                timeout=600, message="every export to succeed")
    last_done = time.monotonic() - restarted_at
    # The two whose acknowledgement was lost come again: their second runs find the work done.
    wait_logged(cluster, lambda: TaskRun.objects.filter(outcome=Outcome.RUNNING).count() == 0, timeout=60,
                message="every run finished")
    cluster.stop()
    print(f"\nRabbitMQ restart with {QUEUED} exports queued and {RUNNING} running: the last export finished "
          f"{last_done:.1f} s after the restart began; the reconciler runs every {RECONCILER_CRON_S} s and "
          f"re-sends only exports queued for over {django_settings.FAIRSHARE['EXPORT_STALE_AFTER_S']} s")

    for record in ExportRecord.objects.all():
        assert notifications(mail_dir, record) == 1
    files = stored_files(export_root)
    assert len(files) == 2 * len(records) and len(set(files)) == len(files)  # one object + manifest each
    assert not TaskRun.objects.filter(job="exports.reconcile").exists()  # no reconciler ran
    outcomes = list(TaskRun.objects.filter(job=BUILD_JOB).values_list("outcome", flat=True))
    assert outcomes.count(Outcome.SUCCEEDED) == len(records)
    assert set(outcomes) <= {Outcome.SUCCEEDED, Outcome.SKIPPED}
    used = UsageDay.objects.filter(queue="exports").aggregate(s=Sum("cpu_used_ms"), r=Sum("cpu_reserved_ms"))
    assert used["s"] == TaskRun.objects.filter(job=BUILD_JOB).aggregate(s=Sum("cpu_ms"))["s"] and used["r"] == 0
    assert not Reservation.objects.filter(status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).exists()
    assert not DeadLetter.objects.exists() and not DeferredTask.objects.exists()
