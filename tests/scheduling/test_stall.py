"""A pool whose workers beat but do no work is unhealthy, and ends itself so its supervisor starts
it again: the backstop for what nobody foresaw.

A killed worker no longer stalls its pool (scheduling.pool, tests/scheduling/test_pool.py). What
stands in here for the unforeseen is a frozen sentinel (SIGSTOP): it hands out no more tasks, while
the pool's pusher goes on fetching into the pool's queue and its idle workers' pulse threads keep
writing heartbeats. /healthz and /metrics must see the stall by the work not started, whether or
not the message was fetched, and the pool must get itself restarted under a plain supervisor
(scheduling.stuck), which brings the waiting export through.
"""
import datetime as dt
import os
import signal
import time
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets.models import Account
from exports.maintenance import reconcile_exports
from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from scheduling.models import Outcome, TaskRun, WorkerHeartbeat
from scheduling.processes import Supervisor
from scheduling.runtime import enqueue
from tests.conftest import wait_for
from tests.exports.support import RANGE, add_events, wait_finished, wait_runs_settled

pytestmark = pytest.mark.django_db(transaction=True)

POOL = {"FAIRSHARE_EXPORT_WORKERS": "1", "FAIRSHARE_WORKER_HEARTBEAT": "1", "FAIRSHARE_RELEASE_POLL": "0.2"}


def healthz() -> tuple[int, dict]:
    response = Client().get("/healthz")
    return response.status_code, response.json()


def exports_workers() -> set[int]:
    return {int(w.rsplit(":", 1)[1]) for w in WorkerHeartbeat.objects.filter(queue="exports")
            .values_list("worker", flat=True)}


def freeze_sentinel(worker: int) -> int:
    """SIGSTOP the sentinel of `worker`'s pool (the worker's parent); returns its pid. The pool ends
    it with SIGKILL (scheduling.stuck), as does `Cluster.stop` after its timeout."""
    sentinel = int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(sentinel, signal.SIGSTOP)
    return sentinel


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
    freeze_sentinel(worker)

    # The stuck pool's pusher fetches two of these (one into the pool's internal queue, one it
    # then waits to put there): the third waits in the broker, unfetched.
    records = [export_request(account_slug="acme", user=owner, **RANGE, idempotency_key=f"k{i}")[0] for i in range(3)]
    status, body = wait_for(lambda: (r := healthz())[1]["checks"]["workers:exports"] != "ok" and r, timeout=30,
                            message=f"/healthz to see the stall; log:\n{cluster.log()}")
    assert status == 503
    problem = body["checks"]["workers:exports"]
    # Seen from outside (messages wait in the broker) and by the pool itself (work waits in it).
    assert problem.startswith("stalled: ") and "restart the pool" in problem, problem
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


# The pool's own view, fast: stalled after 10 s, ended after 15 s. A short `retry` (above the
# timeout, as scheduling.E001 wants) stands in for the reconciler, which re-sends a queued export
# only on its minute tick: the messages the stuck pool fetched come again to the new pool.
SELF_HEALING = {**POOL, "FAIRSHARE_EXPORT_WORKERS": "2", "FAIRSHARE_QUEUE_STALL_AFTER_S": "10",
                "FAIRSHARE_STALLED_POOL_EXIT_AFTER_S": "15", "FAIRSHARE_EXPORT_TIMEOUT": "20",
                "FAIRSHARE_EXPORT_RETRY": "30", "FAIRSHARE_EXPORT_ATTEMPT_DEADLINE": "15"}
STALL_AFTER_S, EXIT_AFTER_S = 10, 15


def probe_runs(account, n: int) -> bool:
    """Whether a tiny exports job sent now starts within a few seconds."""
    ref = f"0/probe-{n}"
    enqueue(job="tests.hold_exports_worker", account=account.pk, ref=ref)
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        if TaskRun.objects.filter(ref=ref).exists():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.processes
def test_a_stalled_pool_ends_itself_and_its_supervisor_brings_the_export_through(account, owner, start_cluster,
                                                                                 settings):
    add_events(account, 100)
    Account.objects.filter(pk=account.pk).update(plan="enterprise")
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": STALL_AFTER_S}
    supervisor = Supervisor(lambda: start_cluster("exports", **SELF_HEALING))
    try:
        first = supervisor.cluster
        workers = wait_for(lambda: len(w := exports_workers()) == 2 and w, timeout=60,
                           message=f"two workers; log:\n{first.log()}")
        assert probe_runs(account, 0), f"the pool works; log:\n{first.log()}"
        freeze_sentinel(min(workers))
        requested = time.monotonic()
        (record, _) = export_request(account_slug="acme", user=owner, **RANGE, idempotency_key="after-the-stall")

        # Seen within the threshold: the stuck pool fetched what was sent to it, and says so itself.
        status, body = wait_for(lambda: (r := healthz())[1]["checks"]["workers:exports"] != "ok" and r,
                                timeout=STALL_AFTER_S + 30, message=f"/healthz to see the stall; log:\n{first.log()}")
        assert status == 503 and body["checks"]["workers:exports"].startswith("stalled: work has waited"), body
        assert stalled_metric().endswith(" 1.0")
        assert supervisor.exits == [] and first.alive()  # said before the pool ends itself
        # The pool ends itself (non-zero: its main PID SIGKILLed), the supervisor starts it again,
        # and the export runs once, within the stall threshold and a minute of being requested.
        wait_for(lambda: supervisor.exits, timeout=EXIT_AFTER_S + 30, message=f"the pool to exit; log:\n{first.log()}")
        assert supervisor.exits[0] != 0
        assert "pool stuck" in first.log()
        assert wait_finished(record, supervisor.cluster, timeout=STALL_AFTER_S + 60 - (time.monotonic() - requested)
                             ).status == ExportStatus.SUCCEEDED
        assert wait_runs_settled(record, supervisor.cluster).count(Outcome.SUCCEEDED) == 1
        wait_for(lambda: healthz()[1]["checks"]["workers:exports"] == "ok", timeout=30,
                 message=f"/healthz to clear; log:\n{supervisor.cluster.log()}")
        assert stalled_metric().endswith(" 0.0")
        assert supervisor.exits == [supervisor.exits[0]]  # the new pool works: it does not end itself
    finally:
        supervisor.stop()


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
