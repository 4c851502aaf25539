"""An export worker SIGKILLed mid-run on the RabbitMQ broker: RabbitMQ itself delivers the message
again once the dead run's leases expired (the pusher sees the worker that took it die; the
queue's `retry`, half an hour, is not waited for), with no reconciler re-ringing the doorbell, and the work is done once in effect:
one object, one notice, an exact ledger."""
import pytest
from django.db.models import Sum

from budgets.models import Reservation, ReservationStatus, UsageDay
from exports.models import AttemptOutcome, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.models import DeadLetter, Outcome, TaskRun
from tests.exports.support import (
    RANGE, add_events, assert_published_once, attempts, notifications, wait_dead_run_lost, wait_finished, wait_logged,
    wait_runs_settled,
)

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

ROWS = 1000  # 20 batches of 50: "mid_stream" fires after the first


def test_worker_killed_mid_export_is_redelivered_by_rabbitmq_and_done_once(
    rabbitmq, account, owner, export_root, mail_dir, start_exports, tmp_path,
):
    add_events(account, ROWS)
    marker = tmp_path / "fault-fired"
    # FAST_RECOVERY's leases are 2 s: the message goes again 5 s after its worker died.
    cluster = start_exports(FAIRSHARE_FAULT="mid_stream", FAIRSHARE_FAULT_MARKER=str(marker),
                            FAIRSHARE_RABBITMQ_REDELIVER_AFTER_DEATH_S="5", **rabbitmq.env)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    wait_logged(cluster, marker.exists, timeout=60, message="the worker to die mid-stream")

    # The dead run's slot comes back at once (its pool's sentinel gives it back, as on every
    # broker). No reconciler re-sends the export: RabbitMQ delivers the message again.
    wait_dead_run_lost(record)
    wait_finished(record, cluster, timeout=60)
    assert "worker died with a message; it goes again later" in cluster.log()
    wait_runs_settled(record, cluster)
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED
    assert not Reservation.objects.filter(status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).exists()
    cluster.stop()

    assert_published_once(record, export_root, rows=ROWS)
    assert notifications(mail_dir, record) == 1
    assert attempts(record) == [AttemptOutcome.SUPERSEDED, AttemptOutcome.SUCCEEDED]
    build_runs = TaskRun.objects.filter(job=BUILD_JOB, ref=str(record.pk))
    assert sorted(build_runs.values_list("outcome", flat=True)) == sorted([Outcome.LOST, Outcome.SUCCEEDED])
    # The ledger charged exactly what the two runs recorded, and holds nothing back.
    charged = UsageDay.objects.filter(account=account, queue="exports").aggregate(
        used=Sum("cpu_used_ms"), reserved=Sum("cpu_reserved_ms"))
    assert charged["used"] == build_runs.aggregate(s=Sum("cpu_ms"))["s"]
    assert charged["reserved"] == 0
    assert not DeadLetter.objects.exists()
