"""A worker frozen inside a transaction (SIGSTOP, as a VM pause would) holds its row locks only
until PostgreSQL ends its session (FAIRSHARE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S): the transaction is
rolled back, the lock freed, and the work that waited for it goes on while the worker is still
frozen. When it wakes, its write is gone and it goes on working on a new connection.
"""
import contextlib
import os
import signal
from pathlib import Path

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from exports.models import ExportRecord, ExportStatus
from exports.requests import BUILD_JOB
from scheduling.models import Outcome, TaskRun
from scheduling.processes import wait_ready
from scheduling.runtime import enqueue
from scheduling.testing import TEST_GATE
from tests.conftest import wait_for
from tests.exports.support import RANGE, add_events, wait_finished
from tests.jobs import FROZEN_WRITE

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

# Long enough for the exports worker to be seen waiting for the lock first, short for a test.
IDLE_IN_TRANSACTION_S = 8


def row_locked(export_id) -> bool:
    try:
        with transaction.atomic():
            ExportRecord.objects.select_for_update(nowait=True).get(pk=export_id)
    except DatabaseError:
        return True
    return False


def lock_waits() -> list[tuple[int, list[int]]]:
    """(backend pid, the pids blocking it) of every session of this database waiting for a lock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid, pg_blocking_pids(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND wait_event_type = 'Lock'")
        return [(pid, list(blockers)) for pid, blockers in cursor.fetchall() if blockers]


def backend_alive(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid])
        return cursor.fetchone() is not None


def stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): state T in /proc/<pid>/stat."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_a_frozen_lock_holder_is_cut_off_and_the_work_waiting_for_it_goes_on(account, owner, start_cluster,
                                                                             tmp_path):
    add_events(account, 50)
    gate = tmp_path / "gate"
    bound = {"FAIRSHARE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S": str(IDLE_IN_TRANSACTION_S)}
    since = timezone.now()
    default = start_cluster("default", FAIRSHARE_WORKERS="1", **{TEST_GATE.env: str(gate)}, **bound)
    exports = start_cluster("exports", FAIRSHARE_EXPORT_WORKERS="1", **bound)
    wait_ready([default, exports], {"default": 1, "exports": 1}, since=since)
    # A queued export whose doorbell is rung only once its row is locked.
    record = ExportRecord.objects.create(account=account, requested_by=owner, start_date=RANGE["start"],
                                         end_date=RANGE["end"], source="activity", status=ExportStatus.QUEUED)

    enqueue(job="tests.hold_row_lock", account=account.pk, ref=f"120000/{record.pk}")
    wait_for(lambda: row_locked(record.pk), timeout=60, message=f"the job to lock the row; log:\n{default.tail()}")
    holder = TaskRun.objects.get(job="tests.hold_row_lock")
    worker_pid = int(holder.worker.rsplit(":", 1)[1])
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        enqueue(job=BUILD_JOB, account=account.pk, ref=str(record.pk))
        # The export's claim waits for the frozen worker's lock...
        ((waiter, (frozen_backend,)),) = wait_for(lock_waits, timeout=30,
                                                  message=f"the claim to wait; log:\n{exports.tail()}")
        # ...until the server ends the frozen session, and the export runs, the worker still frozen.
        wait_for(lambda: not backend_alive(frozen_backend), timeout=IDLE_IN_TRANSACTION_S + 30,
                 message="the server to end the frozen session")
        assert wait_finished(record, exports).status == ExportStatus.SUCCEEDED
        assert stopped(worker_pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker_pid, signal.SIGCONT)

    # Awake, the frozen job's transaction cannot commit: its write was rolled back with the session.
    gate.touch()
    wait_for(lambda: TaskRun.objects.filter(pk=holder.pk).exclude(outcome=Outcome.RUNNING).exists(), timeout=60,
             message=f"the woken job to end; log:\n{default.tail()}")
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED and record.error_message != FROZEN_WRITE
    # The woken worker goes on working on a new connection.
    enqueue(job="tests.noop", account=account.pk, ref="after-the-freeze")
    after = wait_for(lambda: TaskRun.objects.filter(ref="after-the-freeze", outcome=Outcome.SUCCEEDED).first(),
                     timeout=60, message=f"the next job; log:\n{default.tail()}")
    assert after.worker == holder.worker
