"""Settlement survives a dropped database connection, and a run that cannot settle is charged
what it recorded: "settlement charges exactly the run's recorded CPU" (SPEC §4)."""
import datetime as dt

import pytest
from django.db import connection
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, Reservation, UsageDay
from budgets.admission import admit
from budgets.reclaim import reclaim_expired
from scheduling.envelope import Envelope
from scheduling.models import Outcome, TaskRun, WorkerHeartbeat
from scheduling.runtime import enqueue, execute
from scheduling.services import task_runs_sweep_lost
from tests.conftest import backend_waiting_for, connect_outside_django, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# A run that burns this much CPU, on a worker that reports its CPU only every 5 s (the default
# heartbeat) and reserves in steps large enough that it never asks for more mid-run.
SPIN_MS = 800
WORKER = {"FAIRSHARE_RESERVATION_STEP": "5000", "FAIRSHARE_RESERVATION_HEARTBEAT": "5", "FAIRSHARE_WORKERS": "1"}


def run_job(job: str) -> TaskRun:
    """Run a maintenance job here and now, through the runner, as its schedule would."""
    execute({"v": 1, "job": job, "account": None, "ref": f"schedule:{job}"})
    return TaskRun.objects.filter(job=job).latest("pk")


@pytest.mark.processes
def test_settlement_reconnects_after_its_connection_dropped(account, start_cluster):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10_000, max_concurrent=2)
    cluster = start_cluster("default", **WORKER)
    enqueue(job="tests.spin", account=account.pk, ref=f"{SPIN_MS}/settle")
    wait_for(lambda: Reservation.objects.filter(ref=f"{SPIN_MS}/settle", task_run__isnull=False).exists(),
             timeout=60, message=f"the run to be admitted; log:\n{cluster.log()}")

    # A slow transaction (or a failover) holds the account's ledger row of the day while the run
    # finishes: its settlement waits on the lock, and then its connection is cut.
    locker = connect_outside_django()
    try:
        locker.execute("SELECT 1 FROM budgets_usageday WHERE account_id = %s AND queue = 'default' FOR UPDATE",
                       [account.pk])
        blocked = wait_for(lambda: backend_waiting_for(locker, "WITH r AS (%DELETE FROM budgets_reservation%"),
                           timeout=30, message=f"the settlement to wait on the ledger row; log:\n{cluster.log()}")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [blocked])
    finally:
        locker.rollback()
        locker.close()

    run = wait_for(lambda: TaskRun.objects.filter(job="tests.spin", finished_at__isnull=False,
                                                  outcome__in=[Outcome.SUCCEEDED, Outcome.FAILED]).first(),
                   timeout=30, message=f"the run to be recorded; log:\n{cluster.log()}")
    assert (run.outcome, run.error_class) == (Outcome.SUCCEEDED, "")
    assert run.cpu_ms >= SPIN_MS * 0.9
    # Settled exactly once, for exactly what the run recorded, and the slot is free at once.
    wait_for(lambda: not Reservation.objects.exists(), timeout=10, message="the slot to be given back")
    day = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert (day.cpu_used_ms, day.cpu_reserved_ms, day.runs) == (run.cpu_ms, 0, 1)
    assert "terminating connection" not in run.error_message


def test_a_run_that_could_not_settle_is_charged_what_it_recorded_when_reclaimed(account):
    """The database stayed away through every settlement try: the run was recorded (445 ms) but
    its reservation stayed, with the 0 ms its last heartbeat reported. Reclaiming charges 445."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10_000, max_concurrent=2)
    run = TaskRun.objects.create(account=account, job="tests.spin", ref="445/x", started_at=timezone.now())
    admission = admit(envelope=Envelope(job="tests.spin", account=account.pk, ref="445/x"), queue="default",
                      estimate_ms=100, run=run, worker="host:1")
    TaskRun.objects.filter(pk=run.pk).update(outcome=Outcome.FAILED, cpu_ms=445, finished_at=timezone.now(),
                                             error_class="django.db.utils.OperationalError")
    Reservation.objects.filter(pk=admission.slot_id).update(
        cpu_reported_ms=0, lease_expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert reclaim_expired() == 1
    day = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert (day.cpu_used_ms, day.cpu_reserved_ms, day.runs) == (445, 0, 1)
    assert TaskRun.objects.get(pk=run.pk).outcome == Outcome.FAILED  # not "lost": it did finish


@pytest.mark.processes
def test_a_worker_killed_after_settling_leaves_a_complete_record_of_what_was_charged(
    account, start_cluster, tmp_path, settings,
):
    """SIGKILL straight after settlement: the run's record was completed with it (outcome, and
    the figures the ledger was charged), so nothing is left for a reclaim or the lost-run sweep."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10_000, max_concurrent=2)
    marker = tmp_path / "fault-fired"
    cluster = start_cluster("default", **WORKER, FAIRSHARE_FAULT="after_settle", FAIRSHARE_FAULT_MARKER=str(marker))
    enqueue(job="tests.spin", account=account.pk, ref="300/killed")
    wait_for(marker.exists, timeout=60, message=f"the worker to die after settling; log:\n{cluster.log()}")

    run = TaskRun.objects.get(job="tests.spin")
    assert run.outcome == Outcome.SUCCEEDED and run.items > 0 and run.finished_at is not None
    assert not Reservation.objects.exists()  # the slot is free already: nothing for a reclaim to do
    day = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert run.cpu_ms >= 300 * 0.9 and (day.cpu_used_ms, day.runs) == (run.cpu_ms, 1)

    # Its worker has been silent for longer than the heartbeat age (1 s here): the sweep has
    # nothing to mark.
    settings.FAIRSHARE = {**settings.FAIRSHARE, "HEALTH_HEARTBEAT_MAX_AGE_S": 1}
    wait_for(lambda: not WorkerHeartbeat.objects.filter(
        worker=run.worker, seen_at__gte=timezone.now() - dt.timedelta(seconds=1)).exists(),
        timeout=30, message="the killed worker's heartbeat to be older than 1 s")
    assert task_runs_sweep_lost() == 0
    run.refresh_from_db()
    assert (run.outcome, run.cpu_ms) == (Outcome.SUCCEEDED, day.cpu_used_ms)


def test_the_sweep_leaves_runs_of_live_workers_and_unsettled_account_runs_alone(account, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "HEALTH_HEARTBEAT_MAX_AGE_S": 60}
    long_ago = timezone.now() - dt.timedelta(minutes=5)
    WorkerHeartbeat.objects.create(worker="host:1", queue="default", seen_at=timezone.now())
    live = TaskRun.objects.create(job="scheduling.release_deferred", worker="host:1", started_at=long_ago)
    unsettled = TaskRun.objects.create(account=account, job="tests.spin", worker="host:2", started_at=long_ago)
    dead = TaskRun.objects.create(job="scheduling.release_deferred", worker="host:2", started_at=long_ago)
    assert run_job("scheduling.sweep_lost_runs").items == 1
    outcomes = dict(TaskRun.objects.filter(pk__in=[live.pk, unsettled.pk, dead.pk]).values_list("pk", "outcome"))
    assert outcomes == {live.pk: Outcome.RUNNING, unsettled.pk: Outcome.RUNNING, dead.pk: Outcome.LOST}
