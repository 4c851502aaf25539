"""Crash safety of exports with real `qcluster` workers (SIGKILL, SIGTERM, lost and duplicate
messages): whatever happens to a worker, an export ends with exactly one whole object under its
key, a record that describes it, every attempt on record, and one notification."""
import datetime as dt
import os
import signal
import subprocess
import time

import pytest
import redis
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.models import OrmQ
from django_q.tasks import async_task

from budgets.models import Account, Reservation, ReservationStatus
from exports.leases import export_cancel
from exports.maintenance import reconcile_exports
from exports.models import AttemptOutcome, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.envelope import Envelope
from scheduling.models import DeferredTask, Outcome, TaskRun
from scheduling.runtime import RUNNER, execute, send
from tests.conftest import pause_at, wait_for
from tests.storages import GATE_ENV
from tests.exports.support import (
    RANGE, add_events, assert_published_once, attempts, file_ids, lease_expired, notifications,
    object_key, runs, stored_files, wait_dead_run_lost, wait_finished, wait_logged, wait_runs_settled,
)

GATED_STORAGE = "tests.storages.GatedStorage"

# Work is sent as in production with workers beating before it (their pulses may not have beaten yet).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes, pytest.mark.usefixtures("beating_workers")]

ROWS = 1000  # 20 batches of 50: the fault "mid_stream" fires after the first


def _recover_from_dead_worker(record, *, resend: bool) -> None:
    """What happens once a worker died: its run's budget slot is given back (by its pool's
    sentinel, or the reclaim once the slot's lease expired), and the reconciler re-rings the
    doorbell when the export's lease has expired."""
    wait_dead_run_lost(record)
    if resend:
        wait_for(lambda: lease_expired(record), timeout=30, message="the dead attempt's export lease to expire")
        assert reconcile_exports() == 1
    else:
        assert reconcile_exports() == 0


# The crash matrix on each broker and each kind of export storage (S3: the real server scripts/test starts).
# Not parametrised: the duplicate-delivery and redelivery-while-running cases are about the ORM
# broker's own redelivery (Redis never redelivers), and the SIGTERM case holds its publish with
# tests.storages.GatedStorage, a local storage by construction.
BROKERS_AND_STORES = pytest.mark.parametrize(
    ("broker", "export_store"), [("orm", "local"), ("redis", "local"), ("orm", "s3"), ("redis", "s3")],
    indirect=True, ids=["orm-local", "redis-local", "orm-s3", "redis-s3"])


@BROKERS_AND_STORES
@pytest.mark.parametrize("point", ["after_claim", "mid_stream", "after_publish", "after_complete"])
def test_worker_killed_at_each_fault_point_ends_with_exactly_one_result(
    point, account, owner, broker, export_store, mail_dir, start_exports, tmp_path,
):
    export_root = export_store  # local files or the S3 bucket: the support helpers read either
    add_events(account, ROWS)
    marker = tmp_path / "fault-fired"
    cluster = start_exports(FAIRSHARE_FAULT=point, FAIRSHARE_FAULT_MARKER=str(marker), **broker.env, **export_store.env)

    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    key = object_key(record)
    wait_logged(cluster, marker.exists, timeout=60, message=f"the worker to die at {point}")
    killed = TaskRun.objects.get(job=BUILD_JOB, ref=str(record.pk))

    # What the crash left behind.
    record.refresh_from_db()
    if point in ("after_claim", "mid_stream"):
        assert record.status == ExportStatus.RUNNING
        assert record.rows_written == (0 if point == "after_claim" else 50)  # progress of batch 1
        assert stored_files(export_root) == []  # nothing published, not even a partial object
    elif point == "after_publish":
        assert record.status == ExportStatus.RUNNING
        assert stored_files(export_root) == [key, key + ".manifest.json"]
    else:
        assert record.status == ExportStatus.SUCCEEDED
    published = file_ids(export_root, stored_files(export_root))

    _recover_from_dead_worker(record, resend=point != "after_complete")
    assert TaskRun.objects.get(pk=killed.pk).outcome == Outcome.LOST
    wait_finished(record, cluster)
    wait_runs_settled(record, cluster)

    # Much later the ORM broker redelivers the dead run's own message (after `retry`; Redis never
    # does, and a duplicate from anywhere is the same case): harmless.
    send(job=BUILD_JOB, account=account.pk, ref=str(record.pk))
    wait_logged(cluster, lambda: runs(record).count(Outcome.SKIPPED) == 1, timeout=30,
                message="the late redelivery to be skipped")
    wait_runs_settled(record, cluster)

    assert_published_once(record, export_root, rows=ROWS)
    assert notifications(mail_dir, record) == 1
    assert record.notified_at is not None
    if point == "after_complete":
        assert attempts(record) == [AttemptOutcome.SUCCEEDED]
        assert record.attempt_count == 1
        assert runs(record) == [Outcome.LOST, Outcome.SKIPPED]
    else:
        last = AttemptOutcome.RECONCILED if point == "after_publish" else AttemptOutcome.SUCCEEDED
        assert attempts(record) == [AttemptOutcome.SUPERSEDED, last]
        assert record.attempt_count == 2
        assert runs(record) == [Outcome.LOST, Outcome.SUCCEEDED, Outcome.SKIPPED]
    if point in ("after_publish", "after_complete"):
        # Nothing was published again: the very same files, never rewritten.
        assert file_ids(export_root, stored_files(export_root)) == published
    # The dead run's slot came back and nothing is left waiting.
    assert not Reservation.objects.filter(status=ReservationStatus.ACTIVE).exists()
    assert not DeferredTask.objects.exists()


@pytest.mark.parametrize("plan", ["enterprise", "standard"])
def test_same_envelope_delivered_twice_at_once_gives_one_result(
    plan, account, owner, export_root, mail_dir, start_exports,
):
    """Enterprise: both deliveries are admitted and run side by side; the claim's row lock and
    lease turn the second away. Standard (one export at a time): the second waits in the holding
    area, is released when the first settles, and finds the export done."""
    Account.objects.filter(pk=account.pk).update(plan=plan)
    rows = 10_000  # a couple of seconds: long enough for both deliveries to overlap
    add_events(account, rows)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    send(job=BUILD_JOB, account=account.pk, ref=str(record.pk))  # the same envelope again
    assert OrmQ.objects.count() == 2
    cluster = start_exports(FAIRSHARE_EXPORT_WORKERS="2")  # both are picked up at once

    wait_finished(record, cluster)
    expected = [Outcome.SKIPPED, Outcome.SUCCEEDED]
    if plan == "standard":
        expected = [Outcome.DEFERRED, *expected]
    wait_logged(cluster, lambda: sorted(runs(record)) == expected, timeout=30, message=f"runs {expected}")
    if plan == "enterprise":
        built = TaskRun.objects.get(ref=str(record.pk), outcome=Outcome.SUCCEEDED)
        skipped = TaskRun.objects.get(ref=str(record.pk), outcome=Outcome.SKIPPED)
        assert skipped.started_at < built.finished_at  # they really ran at the same time
    assert attempts(record) == [AttemptOutcome.SUCCEEDED]
    assert record.attempt_count == 1
    assert_published_once(record, export_root, rows=rows)
    assert notifications(mail_dir, record) == 1
    assert not DeferredTask.objects.exists()


def test_broker_redelivering_while_the_first_run_is_still_going_changes_nothing(
    account, other_account, owner, export_root, mail_dir, start_exports, tmp_path,
):
    """django-q2's ORM broker counts `retry` from dequeue, including the time a fetched task
    waits for a free worker: even with retry > timeout, a task that waited is delivered again
    while it runs. Here both workers are busy when the export's message is fetched; they are let
    go shortly before its `retry` runs out, so the export starts, and its message comes round
    again mid-run, to the other worker."""
    timeout_s, retry_s = 15, 16
    gate = tmp_path / "let-workers-go"
    Account.objects.filter(pk__in=[account.pk, other_account.pk]).update(plan="enterprise")
    rows = 20_000  # some seconds at 50 rows a batch, well within the timeout
    add_events(account, rows)
    publish_gate = tmp_path / "let-publish-go"
    # The export waits in its publish step until the test lets it go, so the redelivery lands
    # mid-run on any machine; its lease outlasts that wait, so the redelivery finds it alive.
    cluster = start_exports(FAIRSHARE_EXPORT_WORKERS="2", FAIRSHARE_EXPORT_TIMEOUT=str(timeout_s),
                            FAIRSHARE_EXPORT_RETRY=str(retry_s), FAIRSHARE_TEST_GATE=str(gate),
                            # Below the timeout, or the cluster refuses to start (check exports.E001).
                            FAIRSHARE_EXPORT_ATTEMPT_DEADLINE=str(timeout_s - 1),
                            FAIRSHARE_EXPORT_LEASE="30", FAIRSHARE_EXPORTS_STORAGE_BACKEND=GATED_STORAGE,
                            **{GATE_ENV: str(publish_gate)})
    for n in range(2):  # another account's work occupies both workers until the gate opens
        envelope = Envelope(job="tests.hold_exports_worker", account=other_account.pk, ref=f"60000/{n}")
        async_task(RUNNER, envelope.to_message(), cluster="exports", timeout=90)
    wait_logged(cluster, lambda: TaskRun.objects.filter(job="tests.hold_exports_worker", outcome=Outcome.RUNNING).count() == 2,
                timeout=60, message="both workers to be busy")
    OrmQ.objects.all().delete()  # acknowledge the blockers now: only the export's delivery is at stake

    record, _ = export_request(account_slug="acme", user=owner, **RANGE)

    def fetched():  # by the cluster, which starts the message's `retry` clock; no worker is free
        return next((q.lock for q in OrmQ.objects.filter(lock__gt=timezone.now())
                     if q.name() == f"{BUILD_JOB}:{record.pk}"), None)

    redelivery_at = wait_logged(cluster, fetched, timeout=10, message="the export's message to be fetched")
    wait_for(lambda: timezone.now() >= redelivery_at - dt.timedelta(seconds=1.5), timeout=retry_s,
             message="shortly before the redelivery")
    assert runs(record) == []
    gate.touch()  # the workers are free: the export starts, one worker stays idle
    wait_logged(cluster, lambda: Outcome.SKIPPED in runs(record), timeout=30,
                message="a second delivery, skipped while the first run holds the lease")
    publish_gate.touch()
    wait_finished(record, cluster, timeout=90)
    wait_logged(cluster, lambda: sorted(runs(record)) == [Outcome.SKIPPED, Outcome.SUCCEEDED], timeout=30,
                message="the first run to finish")

    built = TaskRun.objects.get(ref=str(record.pk), outcome=Outcome.SUCCEEDED)
    again = TaskRun.objects.get(ref=str(record.pk), outcome=Outcome.SKIPPED)
    timeline = [(r.job, r.outcome, r.worker, r.started_at.time(), r.finished_at.time())
                for r in TaskRun.objects.order_by("started_at")]
    assert built.started_at < redelivery_at <= again.started_at < built.finished_at, timeline  # mid-run
    assert built.worker != again.worker
    assert attempts(record) == [AttemptOutcome.SUCCEEDED]
    assert record.attempt_count == 1
    assert_published_once(record, export_root, rows=rows)
    assert notifications(mail_dir, record) == 1


def test_lost_doorbell_is_rung_again_by_the_reconciler(
    account, owner, export_root, mail_dir, start_exports, settings, broker,
):
    add_events(account, ROWS)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    queue = get_broker("exports")
    assert queue.queue_size() == 1
    # The broker lost the message (say, a Redis broker restarted, or an operator purged a queue).
    if broker.name == "redis":
        redis.from_url(broker.env["REDIS_URL"]).flushdb()
    elif broker.name == "rabbitmq":
        queue.purge_queue()
    else:
        OrmQ.objects.all().delete()
    assert queue.queue_size() == 0
    cluster = start_exports(**broker.env)
    wait_logged(cluster, lambda: "running." in cluster.log(), timeout=60, message="the cluster to start")
    time.sleep(2)  # many broker polls (every 0.1 s): nothing arrives
    record.refresh_from_db()
    assert record.status == ExportStatus.QUEUED and runs(record) == []

    # What the "reconcile-exports" schedule sends, run here and now through the same runner.
    reconcile = Envelope(job="exports.reconcile", account=None, ref="schedule:reconcile-exports").to_message()
    execute(reconcile)
    assert TaskRun.objects.get(job="exports.reconcile").items == 0  # a fresh request may still be on its way
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_STALE_AFTER_S": 0}
    execute(reconcile)
    assert TaskRun.objects.filter(job="exports.reconcile").latest("started_at").items == 1

    wait_finished(record, cluster)
    assert wait_runs_settled(record, cluster) == [Outcome.SUCCEEDED]
    assert attempts(record) == [AttemptOutcome.SUCCEEDED]
    assert_published_once(record, export_root, rows=ROWS)
    assert notifications(mail_dir, record) == 1
    execute(reconcile)  # done is done
    assert TaskRun.objects.filter(job="exports.reconcile").latest("started_at").items == 0


@BROKERS_AND_STORES
def test_cancelling_mid_stream_publishes_nothing(
    account, owner, broker, export_store, mail_dir, start_exports, tmp_path,
):
    export_root = export_store  # local files or the S3 bucket: the support helpers read either
    rows = 20_000
    add_events(account, rows)
    pause = pause_at("mid_stream", tmp_path)
    cluster = start_exports(**broker.env, **export_store.env, **pause.env)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    wait_logged(cluster, pause.reached, timeout=60, message="the export to pause after its first batch")

    assert export_cancel(export_id=record.pk) == ExportStatus.RUNNING  # honoured at the next batch
    pause.resume()
    wait_finished(record, cluster)
    assert record.status == ExportStatus.CANCELLED
    assert 0 < record.rows_written < rows  # it stopped part-way
    assert wait_runs_settled(record, cluster) == [Outcome.CANCELLED]
    assert attempts(record) == [AttemptOutcome.CANCELLED]
    assert stored_files(export_root) == []  # no object, no manifest
    assert (record.output_key, record.checksum_sha256, record.row_count) == ("", "", None)
    assert notifications(mail_dir, record) == 0 and record.notified_at is None
    assert reconcile_exports() == 0  # and nothing brings it back
    assert not DeferredTask.objects.exists()


@pytest.mark.parametrize("stop", ["graceful", "killed_after_stop_timeout"])
def test_sigterm_mid_export_never_marks_a_partial_object_complete(
    stop, account, owner, export_root, mail_dir, start_exports, tmp_path,
):
    """SIGTERM to the main qcluster PID lets the running export finish. When a supervisor's stop
    timeout runs out first and it SIGKILLs what is left, the export is not complete, and the next
    worker finishes it."""
    rows = 20_000
    add_events(account, rows)
    # The SIGTERM lands while the export stands paused after its first batch, however fast the
    # machine. Killed variant: it then waits in its publish step (a gate never opened), so the
    # stop timeout always runs out mid-export.
    pause = pause_at("mid_stream", tmp_path)
    held = {} if stop == "graceful" else {
        "FAIRSHARE_EXPORTS_STORAGE_BACKEND": GATED_STORAGE, GATE_ENV: str(export_root.parent / "never-opened")}
    cluster = start_exports(**held, **pause.env)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    wait_logged(cluster, pause.reached, timeout=60, message="the export to pause after its first batch")

    cluster.proc.send_signal(signal.SIGTERM)  # the main PID only
    pause.resume()
    try:
        cluster.proc.wait(90 if stop == "graceful" else 1)
    except subprocess.TimeoutExpired:
        os.killpg(cluster.pid, signal.SIGKILL)  # what systemd does after TimeoutStopSec
        cluster.proc.wait(10)

    record.refresh_from_db()
    if record.status == ExportStatus.SUCCEEDED:
        assert stop == "graceful"
        assert runs(record) == [Outcome.SUCCEEDED]
        assert not OrmQ.objects.exists()  # finished and acknowledged before the cluster stopped
    else:
        assert stop == "killed_after_stop_timeout"
        assert record.status == ExportStatus.RUNNING and record.checksum_sha256 == ""
        assert stored_files(export_root) == []  # killed mid-stream: nothing published
        cluster = start_exports()
        _recover_from_dead_worker(record, resend=True)
        wait_finished(record, cluster)
        assert wait_runs_settled(record, cluster) == [Outcome.LOST, Outcome.SUCCEEDED]
        assert attempts(record) == [AttemptOutcome.SUPERSEDED, AttemptOutcome.SUCCEEDED]
    assert_published_once(record, export_root, rows=rows)
    assert notifications(mail_dir, record) == 1
