"""A chaos run: real qcluster workers and a real relay process, two workers SIGKILLed mid-run and
the log's server (a private nats-server) killed and started again in the middle. Afterwards every
settled run has exactly one event in the stream, and the replay finds the ledger as the log says."""
import collections
import os
import signal

import pytest

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus
from budgets.reclaim import reclaim_expired
from scheduling.models import Outcome, TaskRun
from scheduling.processes import Cluster
from scheduling.runtime import enqueue
from tests.conftest import wait_for, worker_env
from tests.usage.test_relay import replay_check, stream_events
from usage.models import UsageEvent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

JOBS = 30


def kill_a_running_worker(account, exclude: set[int]) -> TaskRun:
    """SIGKILL the worker process of one of the account's runs in progress; returns that run."""
    def running():
        return TaskRun.objects.filter(account=account, outcome=Outcome.RUNNING, finished_at__isnull=True).exclude(
            worker="").order_by("-started_at").first()
    run = wait_for(running, timeout=30, message="a run in progress")
    pid = int(run.worker.rsplit(":", 1)[1])
    assert pid not in exclude
    os.kill(pid, signal.SIGKILL)
    return run


def test_every_settled_run_has_one_event_after_killed_workers_and_a_nats_restart(
        account, export_root, tmp_path, private_nats, settings, start_cluster, usage_on):
    # usage_on: this process reclaims the killed runs' slots (the every-minute job's work, as a
    # worker with FAIRSHARE_USAGE_NATS_URL would), so its connection writes events too.
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100_000, max_concurrent=4)
    usage_env = {"FAIRSHARE_USAGE_NATS_URL": private_nats.url,
                 "FAIRSHARE_USAGE_MAX_BYTES": str(settings.FAIRSHARE["USAGE_MAX_BYTES"])}
    cluster = start_cluster("default", FAIRSHARE_WORKERS="3", FAIRSHARE_RESERVATION_LEASE="3",
                            FAIRSHARE_RESERVATION_HEARTBEAT="0.5", FAIRSHARE_TASK_TIMEOUT="30", **usage_env)
    relay = Cluster("default", worker_env(export_root, **usage_env), tmp_path / "usage-relay.log",
                    command="usage_relay")
    try:
        for i in range(JOBS):
            enqueue(job="tests.sleep", account=account.pk, ref=f"{300 + 100 * (i % 5)}/{i}")
        wait_for(lambda: TaskRun.objects.filter(account=account, outcome=Outcome.SUCCEEDED).count() >= 8,
                 timeout=60, message="some runs to succeed")
        killed = [kill_a_running_worker(account, {cluster.pid})]

        private_nats.kill()  # the log goes down: events wait in the outbox
        wait_for(lambda: UsageEvent.objects.count() >= 3, timeout=30, message="events to wait in the outbox")
        killed.append(kill_a_running_worker(account, {cluster.pid}))
        private_nats.start()

        def all_done():
            reclaim_expired()  # the every-minute job, now: the killed runs' leases expire in 3 s
            runs = TaskRun.objects.filter(account=account)
            refs_done = runs.filter(outcome=Outcome.SUCCEEDED).values("ref").distinct().count()
            return (refs_done >= JOBS - len(killed) and not runs.filter(outcome=Outcome.RUNNING).exists()
                    and not Reservation.objects.filter(account=account).exclude(
                        status=ReservationStatus.RECLAIMED).exists())
        wait_for(all_done, timeout=120, interval=0.5, message="the other jobs to succeed and the killed runs "
                                                              f"to be reclaimed\n{cluster.tail(40)}")
        wait_for(lambda: not UsageEvent.objects.exists(), timeout=60,
                 message=f"the relay to empty the outbox\n{relay.tail(20)}")
    finally:
        relay.stop()

    settled = TaskRun.objects.filter(account=account).exclude(outcome=Outcome.RUNNING)
    lost = set(settled.filter(outcome=Outcome.LOST).values_list("pk", flat=True))
    assert {r.pk for r in killed} <= lost, list(TaskRun.objects.filter(pk__in=[r.pk for r in killed]).values_list(
        "pk", "outcome", "error_message", "worker"))
    per_run = collections.Counter(e["run"] for e in stream_events(settings) if e["type"] == "run.settled")
    assert {run: n for run, n in per_run.items() if n != 1} == {}  # none twice
    missing = settled.exclude(pk__in=list(per_run)).values_list("pk", "outcome", "error_class", "error_message",
                                                                  "cpu_ms", "worker")
    assert not list(missing)
    assert set(per_run) == set(settled.values_list("pk", flat=True))  # every settled run, no other
    code, out = replay_check("--check")
    assert code == 0, out
    assert clock.budget_day()  # the day checked is today's
