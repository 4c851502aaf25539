"""A pool whose workers beat but do no work is unhealthy.

An idle django-q2 worker waits for its next task holding the pool's task-queue read lock; SIGKILL
it there and the lock is never given back: the worker django-q2 starts in its place, and every
other, wait for it forever (the upstream queue-lock issue), while their pulse threads keep
writing heartbeats. /healthz and /metrics must see the stall by the work not done, and a restart
of the pool (what the supervisor does on that 503) must bring the waiting export through.
"""
import datetime as dt
import os
import signal
import time

import pytest
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from exports.models import ExportStatus
from exports.maintenance import reconcile_exports
from exports.requests import export_request
from scheduling.models import TaskRun, WorkerHeartbeat
from tests.conftest import wait_for
from tests.exports.support import RANGE, add_events, wait_finished

pytestmark = pytest.mark.django_db(transaction=True)

POOL = {"FAIRSHARE_EXPORT_WORKERS": "1", "FAIRSHARE_WORKER_HEARTBEAT": "1", "FAIRSHARE_RELEASE_POLL": "0.2"}


def healthz() -> tuple[int, dict]:
    response = Client().get("/healthz")
    return response.status_code, response.json()


def exports_workers() -> set[int]:
    return {int(w.rsplit(":", 1)[1]) for w in WorkerHeartbeat.objects.filter(queue="exports")
            .values_list("worker", flat=True)}


def stalled_metric() -> str:
    body = Client().get("/metrics").content.decode()
    return next(line for line in body.splitlines() if line.startswith('fairshare_queue_stalled{queue="exports"}'))


@pytest.mark.processes
def test_a_stalled_pool_is_unhealthy_and_a_restart_runs_its_work(account, owner, start_cluster, settings):
    add_events(account, 100)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 2}
    cluster = start_cluster("exports", **POOL)
    (worker,) = wait_for(exports_workers, timeout=60, message=f"the exports worker to beat; log:\n{cluster.log()}")
    time.sleep(1)  # let it settle into waiting for a task (holding the queue's read lock)
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: exports_workers() - {worker}, timeout=30,
             message=f"django-q2 to start a worker in its place; log:\n{cluster.log()}")

    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    status, body = wait_for(lambda: (r := healthz())[1]["checks"]["workers:exports"] != "ok" and r, timeout=30,
                            message=f"/healthz to see the stall; log:\n{cluster.log()}")
    assert status == 503
    problem = body["checks"]["workers:exports"]
    assert problem.startswith("stalled: a message has waited") and "restart the pool" in problem, problem
    # The other queue is judged on its own (no worker was started for it here).
    assert body["checks"]["workers:default"].startswith("no worker heard from")
    assert stalled_metric().endswith(" 1.0")
    record.refresh_from_db()
    assert record.status == ExportStatus.QUEUED and not TaskRun.objects.exists()  # heartbeats, no work

    # The supervisor's answer to that 503: stop the pool (SIGTERM to the main PID, SIGKILL of what
    # is left after the stop timeout) and start it again. The message the stuck pool fetched is
    # redelivered only after `retry`; the reconciler re-sends the export meanwhile.
    cluster.stop(timeout=5)
    cluster = start_cluster("exports", **POOL)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_STALE_AFTER_S": 0}
    assert reconcile_exports() == 1
    wait_finished(record, cluster)
    assert record.status == ExportStatus.SUCCEEDED
    # The unacknowledged message of the killed pool is still in the broker, but the pool has
    # worked since it was sent: healthy.
    wait_for(lambda: healthz()[1]["checks"]["workers:exports"] == "ok", timeout=30,
             message=f"/healthz to clear; log:\n{cluster.log()}")
    assert stalled_metric().endswith(" 0.0")


@pytest.mark.parametrize("since_sent, expected", [
    (None, True),          # heartbeats, a message waiting, and no work: stalled
    ("running", False),    # a long task is running on a live worker: busy, not stalled
    ("started", False),    # a task started after the message was sent: the pool works
    ("before", True),      # the last task started before the message was sent
])
def test_the_stall_rule(since_sent, expected, account, settings):
    """One message sent 10 s ago, a live worker, and the threshold at 5 s."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 5}
    now = timezone.now()
    sent = now - dt.timedelta(seconds=10)
    OrmQ.objects.create(key="exports", payload=SignedPackage.dumps({"started": sent}), lock=now - dt.timedelta(days=1))
    WorkerHeartbeat.objects.create(worker="host:1", queue="exports", seen_at=now)
    if since_sent:
        started = {"running": sent - dt.timedelta(minutes=5), "started": sent + dt.timedelta(seconds=2),
                   "before": sent - dt.timedelta(seconds=1)}[since_sent]
        TaskRun.objects.create(job="tests.hold_exports_worker", queue="exports", worker="host:1", started_at=started,
                               outcome="running" if since_sent == "running" else "succeeded")
    checks = healthz()[1]["checks"]
    assert checks["workers:exports"].startswith("stalled:") is expected, checks
