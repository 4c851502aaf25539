"""Recovery windows that random chaos rarely hits, held open deliberately with real `qcluster`
workers (a fault point kills the worker with SIGKILL exactly there), on both brokers.

1. The worker dies after its run was admitted, before it claimed the export: the export is still
   `queued`, its run's slot is reclaimed, and the reconciler must ring the doorbell again.
2. The worker dies between completing the export and notifying the requester: the reconciler
   must send the one notice the dead run owed, and never a second one.
"""
import pytest
from django.core import mail

from budgets.models import Reservation, ReservationStatus
from config.mail import mail_to_folder
from budgets.reclaim import reclaim_expired
from exports.maintenance import reconcile_exports
from exports.models import AttemptOutcome, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.models import Outcome, TaskRun
from scheduling.runtime import send
from tests.conftest import wait_for
from tests.exports.support import (
    RANGE, add_events, assert_published_once, attempts, notifications, runs, wait_finished, wait_logged,
    wait_runs_settled,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

ROWS = 300


@pytest.fixture
def reconciler_mail(settings, mail_dir):
    """The reconciler runs in this process: its notices go where the workers' go, to be counted."""
    mail_to_folder(settings, mail_dir)


def _die_at(point, *, broker, account, owner, start_exports, tmp_path):
    """Start an exports worker that kills itself at `point`; request an export and wait for the
    worker to die there. Returns the export and the dead run."""
    add_events(account, ROWS)
    marker = tmp_path / "fault-fired"
    cluster = start_exports(FAIRSHARE_FAULT=point, FAIRSHARE_FAULT_MARKER=str(marker), **broker.env)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    wait_logged(cluster, marker.exists, timeout=60, message=f"the worker to die at {point}")
    return record, cluster, TaskRun.objects.get(job=BUILD_JOB, ref=str(record.pk))


def _reclaim_dead_run(dead_run) -> None:
    """The dead run's slot given back and the run recorded lost: at once by its pool's sentinel
    (scheduling.deaths), else by the reclaim-leases schedule's reclaim once its lease (2 s) expired."""
    def lost() -> bool:
        reclaim_expired()
        return TaskRun.objects.get(pk=dead_run.pk).outcome == Outcome.LOST
    wait_for(lost, timeout=30, message="the dead run's reservation to be reclaimed")


def test_export_whose_worker_died_before_claiming_it_is_sent_again(
    broker, account, owner, export_root, mail_dir, start_exports, tmp_path, settings,
):
    record, cluster, dead_run = _die_at("before_claim", broker=broker, account=account, owner=owner,
                                        start_exports=start_exports, tmp_path=tmp_path)
    record.refresh_from_db()
    assert (record.status, record.attempt_count) == (ExportStatus.QUEUED, 0)  # admitted, never claimed
    _reclaim_dead_run(dead_run)
    assert Reservation.objects.get(ref=str(record.pk)).status == ReservationStatus.RECLAIMED

    # Nothing runs or holds the export now: once it is stale, one reconciler tick re-sends it.
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_STALE_AFTER_S": 0}
    assert reconcile_exports() == 1
    wait_finished(record, cluster)
    assert wait_runs_settled(record, cluster) == [Outcome.LOST, Outcome.SUCCEEDED]
    assert attempts(record) == [AttemptOutcome.SUCCEEDED]
    assert_published_once(record, export_root, rows=ROWS)
    assert notifications(mail_dir, record) == 1
    assert reconcile_exports() == 0  # done is done
    assert not Reservation.objects.filter(status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).exists()


def test_notice_owed_by_a_worker_that_died_after_completing_is_sent_once(
    broker, account, owner, export_root, mail_dir, start_exports, tmp_path, reconciler_mail,
):
    record, cluster, dead_run = _die_at("before_notify", broker=broker, account=account, owner=owner,
                                        start_exports=start_exports, tmp_path=tmp_path)
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED and record.notified_at is None
    assert notifications(mail_dir, record) == 0
    _reclaim_dead_run(dead_run)

    assert reconcile_exports() == 1  # the notice, within one reconciler tick, on either broker
    assert notifications(mail_dir, record) == 1
    assert reconcile_exports() == 0
    # A late duplicate of the dead run's message (the ORM broker redelivers after `retry`) finds
    # the export built and notified: nothing is published or sent again.
    send(job=BUILD_JOB, account=account.pk, ref=str(record.pk))
    wait_logged(cluster, lambda: Outcome.SKIPPED in runs(record), timeout=30, message="the duplicate to be skipped")
    assert wait_runs_settled(record, cluster) == [Outcome.LOST, Outcome.SKIPPED]
    assert_published_once(record, export_root, rows=ROWS)
    assert notifications(mail_dir, record) == 1
    record.refresh_from_db()
    assert record.notified_at is not None
    assert not mail.outbox
    message = next(p for p in mail_dir.iterdir() if str(record.pk).encode() in p.read_bytes()).read_text()
    assert f"Message-ID: <export-ready-{record.pk}@fairshare>" in message
