"""Classified retries of exports with real `qcluster` workers: transient failures (a dropped
database connection, unreachable storage) are retried with back-off until they succeed or run
out of attempts; terminal ones fail at once. Every failure stays inspectable, and redacted."""
import os
from pathlib import Path

import pytest
from django.db import connection
from django_q.models import Failure

from budgets.models import Membership, Reservation, ReservationStatus, Role
from exports.maintenance import reconcile_exports
from exports.models import AttemptOutcome, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.envelope import Envelope
from scheduling.retries import RetryPolicy
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import execute
from tests.conftest import pause_at
from tests.exports.support import (
    RANGE, add_events, assert_published_once, attempts, notifications, stored_files, wait_finished, wait_logged,
    wait_runs_settled,
)
from tests.storages import FAILURES_ENV, LEAKY_SECRET

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

FLAKY_STORAGE = "tests.storages.FlakyStorage"


def _tcp_ports_of(pid: int) -> set[int]:
    """Local TCP ports of a process's sockets (Linux /proc): its database connections."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _streaming_backend() -> int | None:
    """The server process of an export's COPY while it is still sending rows."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND state = 'active' "
            "AND query LIKE 'COPY (%%'"
        )
        row = cursor.fetchone()
    return row[0] if row else None


def _terminate(where: str, params: list) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            f"WHERE datname = current_database() AND pid <> pg_backend_pid() AND {where}",
            params,
        )
        return cursor.fetchone()[0]


@pytest.mark.parametrize("dropped", ["all_worker_connections", "streaming_reader"])
def test_database_connection_dropped_mid_export_is_retried_and_succeeds(
    dropped, account, owner, export_root, mail_dir, start_exports, tmp_path,
):
    # Large enough that PostgreSQL is still sending the COPY while the worker stands paused after
    # its first batch: the socket buffers between them do not hold the rest.
    rows = 100_000
    add_events(account, rows)
    pause = pause_at("mid_stream", tmp_path)
    cluster = start_exports(FAIRSHARE_EXPORT_BATCH_ROWS="1000", **pause.env)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)

    wait_logged(cluster, pause.reached, timeout=60, message="the export to pause after its first batch")
    reader = _streaming_backend()
    assert reader is not None, "the COPY is no longer streaming"
    first = TaskRun.objects.get(job=BUILD_JOB, ref=str(record.pk))
    if dropped == "streaming_reader":
        assert _terminate("pid = %s", [reader]) == 1
    else:
        worker_pid = int(first.worker.rsplit(":", 1)[1])
        # The task's connection, its streaming reader, its watcher's and its pulse's.
        assert _terminate("client_port = ANY(%s)", [sorted(_tcp_ports_of(worker_pid))]) >= 2
    pause.resume()

    wait_finished(record, cluster, timeout=90)
    assert wait_runs_settled(record, cluster) == [Outcome.RETRYING, Outcome.SUCCEEDED]
    first.refresh_from_db()
    # The streaming reader is a raw psycopg connection: its own error, not Django's. Whether libpq
    # reads the server's "terminating connection" notice (AdminShutdown) before it sees the socket
    # close (a plain OperationalError) is a race on a loaded machine; both are a lost connection.
    reader_lost = {"psycopg.errors.AdminShutdown", "psycopg.OperationalError"}
    lost_connection = {"django.db.utils.OperationalError", "django.db.utils.InterfaceError", *reader_lost}
    assert first.error_class in lost_connection, (first.error_class, first.error_message)
    if dropped == "streaming_reader":
        assert first.error_class in reader_lost
    retry = TaskRun.objects.filter(job=BUILD_JOB, ref=str(record.pk)).exclude(pk=first.pk).get()
    assert retry.started_at >= first.finished_at  # a retry after back-off, not a duplicate
    failed, succeeded = record.attempts.order_by("number")
    assert (failed.outcome, succeeded.outcome) == (AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED)
    assert failed.error_class == first.error_class and failed.task_run_id == first.pk
    assert record.attempt_count == 2
    assert_published_once(record, export_root, rows=rows)
    assert notifications(mail_dir, record) == 1
    # The failed run settled on a fresh connection: its slot is free, nothing is left held.
    assert not Reservation.objects.filter(status=ReservationStatus.ACTIVE).exists()
    assert not DeferredTask.objects.exists()


@pytest.fixture
def export_with_flaky_storage(account, owner, start_exports, tmp_path):
    """Request a 300-row export from a cluster whose storage fails its next `failures` saves.

    Returns the export, the cluster, and the file counting the failures still to come."""

    def start(*, failures: int):
        remaining = tmp_path / "storage-failures"
        remaining.write_text(str(failures))
        add_events(account, 300)
        cluster = start_exports(FAIRSHARE_EXPORTS_STORAGE_BACKEND=FLAKY_STORAGE, **{FAILURES_ENV: str(remaining)})
        record, _ = export_request(account_slug="acme", user=owner, **RANGE)
        return record, cluster, remaining

    return start


def test_storage_failing_twice_is_retried_then_succeeds(export_root, mail_dir, export_with_flaky_storage):
    record, cluster, failures = export_with_flaky_storage(failures=2)

    wait_finished(record, cluster, timeout=60)
    assert wait_runs_settled(record, cluster) == [Outcome.RETRYING, Outcome.RETRYING, Outcome.SUCCEEDED]
    assert failures.read_text() == "0"
    assert attempts(record) == [AttemptOutcome.FAILED, AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED]
    assert set(record.attempts.exclude(outcome=AttemptOutcome.SUCCEEDED).values_list("error_class", flat=True)) \
        == {"ConnectionResetError"}
    assert record.attempt_count == 3
    assert_published_once(record, export_root, rows=300)
    assert notifications(mail_dir, record) == 1
    assert not DeferredTask.objects.exists()


def test_storage_failing_past_the_attempt_limit_fails_and_stays_inspectable(
    export_root, mail_dir, export_with_flaky_storage,
):
    record, cluster, failures = export_with_flaky_storage(failures=100)

    # Back-off with full jitter: at most 2 + 4 + 8 + 16 s between the five attempts.
    wait_finished(record, cluster, timeout=90)
    assert record.status == ExportStatus.FAILED
    assert wait_runs_settled(record, cluster) == [Outcome.RETRYING] * 4 + [Outcome.FAILED]
    assert attempts(record) == [AttemptOutcome.FAILED] * 5
    assert record.attempt_count == record.attempt_limit == 5
    assert failures.read_text() == "95"

    # Inspectable: what failed and how, without the path or the credential the error quoted.
    assert record.error_class == "ConnectionResetError"
    stored_errors = [record.error_message,
                     *record.attempts.values_list("error_message", flat=True),
                     *TaskRun.objects.filter(ref=str(record.pk)).values_list("error_message", flat=True)]
    assert len(stored_errors) == 11
    for message in stored_errors:
        assert "Connection reset by peer" in message
        assert "storage.internal" in message  # where it failed is kept...
        assert LEAKY_SECRET not in message  # ...who it was, and which file, are not
        assert str(export_root) not in message and str(record.pk) not in message and "/tmp" not in message
    assert not Failure.objects.exists()  # and no raw traceback in django-q2's tables

    assert stored_files(export_root) == []
    assert notifications(mail_dir, record) == 0
    assert not DeferredTask.objects.exists()
    assert reconcile_exports() == 0  # a failed export stays failed


def test_requester_losing_export_permission_fails_at_once_without_retry(
    account, owner, export_root, mail_dir, start_exports,
):
    add_events(account, 300)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    # Before any worker runs it, the requester is demoted to a role that may not export.
    Membership.objects.filter(user=owner, account=account).update(role=Role.VIEWER)
    cluster = start_exports()

    wait_finished(record, cluster)
    assert record.status == ExportStatus.FAILED
    assert (record.error_class, record.error_message) == (
        "exports.build.ExportNotAuthorised", "the requester may no longer export this account")
    assert wait_runs_settled(record, cluster) == [Outcome.FAILED]
    assert attempts(record) == [AttemptOutcome.FAILED]
    assert record.attempt_count == 1
    assert not DeferredTask.objects.exists()  # no retry waiting either
    assert stored_files(export_root) == []
    assert notifications(mail_dir, record) == 0
    assert reconcile_exports() == 0


def test_any_job_that_lost_its_database_connection_is_held_for_a_retry(account, monkeypatch):
    """The retry middleware itself must not trip over the connection the failure broke."""
    # Full jitter may draw a delay of a few milliseconds, and the run's settlement releases a due
    # job at once; a fixed delay keeps it in the holding area to be looked at.
    monkeypatch.setattr(RetryPolicy, "delay", lambda self, attempt: 60.0)
    ref = "0/dropped-connection"
    execute(Envelope(job="tests.drop_connection", account=account.pk, ref=ref).to_message())

    run = TaskRun.objects.get(ref=ref)
    assert (run.outcome, run.error_class) == (Outcome.RETRYING, "django.db.utils.OperationalError")
    assert DeferredTask.objects.get(ref=ref).reason == DeferReason.RETRY_BACKOFF
    assert not Reservation.objects.filter(status=ReservationStatus.ACTIVE).exists()  # settled
