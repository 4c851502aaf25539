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

from budgets.models import Account
from exports.maintenance import reconcile_exports
from exports.models import ExportRecord, ExportStatus
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
    Account.objects.filter(pk=account.pk).update(plan="enterprise")  # its exports go out side by side
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 2}
    cluster = start_cluster("exports", **POOL)
    (worker,) = wait_for(exports_workers, timeout=60, message=f"the exports worker to beat; log:\n{cluster.log()}")
    time.sleep(1)  # let it settle into waiting for a task (holding the queue's read lock)
    os.kill(worker, signal.SIGKILL)
    wait_for(lambda: exports_workers() - {worker}, timeout=30,
             message=f"django-q2 to start a worker in its place; log:\n{cluster.log()}")

    # The stuck pool's pusher fetches two of these (one into the pool's internal queue, one it
    # then waits to put there): the third waits in the broker, unfetched.
    records = [export_request(account_slug="acme", user=owner, **RANGE, idempotency_key=f"k{i}")[0] for i in range(3)]
    status, body = wait_for(lambda: (r := healthz())[1]["checks"]["workers:exports"] != "ok" and r, timeout=30,
                            message=f"/healthz to see the stall; log:\n{cluster.log()}")
    assert status == 503
    problem = body["checks"]["workers:exports"]
    assert problem.startswith("stalled: messages wait") and "restart the pool" in problem, problem
    # The other queue is judged on its own (no worker was started for it here).
    assert body["checks"]["workers:default"].startswith("no worker heard from")
    assert stalled_metric().endswith(" 1.0")
    assert {r.status for r in ExportRecord.objects.all()} == {ExportStatus.QUEUED}
    assert not TaskRun.objects.exists()  # heartbeats, no work

    # The supervisor's answer to that 503: stop the pool (SIGTERM to the main PID, SIGKILL of what
    # is left after the stop timeout) and start it again. The message the stuck pool fetched is
    # redelivered only after `retry`; the reconciler re-sends the export meanwhile.
    cluster.stop(timeout=5)
    cluster = start_cluster("exports", **POOL)
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_STALE_AFTER_S": 0}
    reconcile_exports()  # the two the stuck pool had fetched (the third's message is still there)
    for record in records:
        assert wait_finished(record, cluster).status == ExportStatus.SUCCEEDED
    # The messages the killed pool fetched stay in the broker until `retry`; no restart could
    # change that, so they do not make the new pool look stalled.
    wait_for(lambda: healthz()[1]["checks"]["workers:exports"] == "ok", timeout=30,
             message=f"/healthz to clear; log:\n{cluster.log()}")
    assert stalled_metric().endswith(" 0.0")


@pytest.mark.parametrize("since_sent, fetched, expected", [
    (None, False, True),          # heartbeats, a message waiting, and no work: stalled
    ("running", False, False),    # a long task is running on a live worker: busy, not stalled
    ("started", False, False),    # a task started after the message was sent: the pool works
    ("before", False, True),      # the last task started before the message was sent
    (None, True, False),          # fetched by a cluster (maybe a killed one): waits for `retry`
])
def test_the_stall_rule(since_sent, fetched, expected, account, settings):
    """One message sent 10 s ago, a live worker, and the threshold at 5 s."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 5}
    now = timezone.now()
    sent = now - dt.timedelta(seconds=10)
    lock = now + dt.timedelta(minutes=20) if fetched else now - dt.timedelta(days=1)
    OrmQ.objects.create(key="exports", payload=SignedPackage.dumps({"started": sent}), lock=lock)
    WorkerHeartbeat.objects.create(worker="host:1", queue="exports", seen_at=now)
    if since_sent:
        started = {"running": sent - dt.timedelta(minutes=5), "started": sent + dt.timedelta(seconds=2),
                   "before": sent - dt.timedelta(seconds=1)}[since_sent]
        TaskRun.objects.create(job="tests.hold_exports_worker", queue="exports", worker="host:1", started_at=started,
                               outcome="running" if since_sent == "running" else "succeeded")
    checks = healthz()[1]["checks"]
    assert checks["workers:exports"].startswith("stalled:") is expected, checks
