"""A killed worker never stalls its pool (scheduling.pool).

One real pool of two workers, on each broker: a worker killed right after taking a task (before
starting it), an idle worker killed, then the other idle one (on django-q2's shared queue, one of
the two holds its read lock: the pool would stall), a busy one, and both at once. After each kill,
new work starts within 10 s of it (printed); in the end every job ran once (a job whose worker was
killed running it has that run recorded lost, and runs again only if the broker delivers it again),
and the usage ledger equals what the runs recorded. With the hand-off on (the default), a busy worker
killed while its account's next job waits in line for the slot it held: that job starts within 10 s
too, because the sentinel gives the dead worker's slot back at once (scheduling.deaths) instead of
when its lease expires (the reclaim runs once a minute). Then the two windows the tables decide: killed
after starting a task and before its run's admission (handed on), and after its run ended and before
handing in the result (handed in for it). And the pieces that must not hang: a timer lock held by a
dead worker, and a graceful stop.
"""
import multiprocessing
import os
import signal
import socket
import threading
from pathlib import Path

import pytest
from django.db.models import Sum
from django.utils import timezone
from django_q.models import OrmQ

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.reclaim import reclaim_expired
from scheduling.models import DeferredTask, Outcome, TaskRun, WorkerHeartbeat
from scheduling.deaths import TimerLock
from scheduling.runtime import enqueue
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

POOL = {"FAIRSHARE_WORKERS": "2", "FAIRSHARE_RESERVATION_LEASE": "3", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5",
        "FAIRSHARE_WORKER_HEARTBEAT": "1", "FAIRSHARE_RELEASE_POLL": "0.2"}
STARTS_WITHIN_S = 10
# Runs that held a slot: the ledger charged each.
CHARGED = (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.BUDGET_EXHAUSTED, Outcome.LOST)
HOST = socket.gethostname()


def workers(cluster) -> set[int]:
    """The live worker processes of `cluster`: by heartbeat, in its session, not yet dead."""
    pids = set()
    for worker in WorkerHeartbeat.objects.filter(queue="default").values_list("worker", flat=True):
        pid = int(worker.rsplit(":", 1)[1])
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if alive and os.getsid(pid) == cluster.pid:
                pids.add(pid)
        except (OSError, IndexError):
            pass
    return pids


def two_idle_workers(cluster) -> list[int]:
    """Both workers up and idle (waiting for their next task), once nothing runs."""
    wait_for(lambda: len(workers(cluster)) == 2 and not TaskRun.objects.filter(outcome=Outcome.RUNNING).exists(),
             timeout=60, message=f"two idle workers; log:\n{cluster.tail(40)}")
    return sorted(workers(cluster))


def kill(cluster, account, victims: list[int], label: str, sends: int = 3, waiting: str | None = None) -> list[str]:
    """SIGKILL `victims`, send `sends` jobs, and time the first start after the kill (of the job
    `waiting` in line, if given). Returns the refs of the jobs the victims were running (their runs
    are lost)."""
    running = list(TaskRun.objects.filter(worker__in=[f"{HOST}:{pid}" for pid in victims], outcome=Outcome.RUNNING)
                   .values_list("ref", flat=True))
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    killed_at = timezone.now()
    for i in range(sends):
        enqueue(job="tests.sleep", account=account.pk, ref=f"100/{label}-{i}")
    starts = TaskRun.objects.filter(started_at__gt=killed_at, **({"ref": waiting} if waiting else {}))
    first = wait_for(lambda: starts.order_by("started_at").values_list("started_at", flat=True).first(),
                     timeout=STARTS_WITHIN_S + 30, message=f"work to start after the kill ({label}); log:\n{cluster.tail(40)}")
    waited = (first - killed_at).total_seconds()
    print(f"\n[{label}] {len(victims)} worker(s) SIGKILLed; {waiting or 'new work'} started {waited:.3f} s later")
    assert waited < STARTS_WITHIN_S, f"{label}: {waiting or 'new work'} started {waited:.1f} s after the kill"
    return running


def settled_runs() -> bool:
    reclaim_expired()  # the runs of killed workers: their leases run out (3 s here)
    return not TaskRun.objects.filter(outcome=Outcome.RUNNING).exists() and not Reservation.objects.exclude(
        status=ReservationStatus.RECLAIMED).exists()


@pytest.mark.processes
def test_killed_workers_never_stall_their_pool(account, broker, start_cluster, tmp_path, settings):
    # A job whose message is lost would wait for its dispatch lease: short here, so that the check
    # below would see such a job again (and call it run twice, or lost, if it were).
    settings.FAIRSHARE = {**settings.FAIRSHARE, "DISPATCH_LEASE_S": 15}
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100_000, max_concurrent=4)
    marker = tmp_path / "taken-not-started"
    cluster = start_cluster("default", **POOL, **broker.env, FAIRSHARE_FAULT="taken_not_started",
                            FAIRSHARE_FAULT_MARKER=str(marker))
    two_idle_workers(cluster)

    # The first task taken kills its worker before it starts: its sentinel hands it to the other.
    enqueue(job="tests.sleep", account=account.pk, ref="100/taken")
    wait_for(lambda: TaskRun.objects.filter(ref="100/taken", outcome=Outcome.SUCCEEDED).exists(), timeout=30,
             message=f"the task a dead worker had taken to run; log:\n{cluster.tail(40)}")
    assert marker.exists() and "died before starting task" in cluster.log()

    first, second = two_idle_workers(cluster)
    lost = kill(cluster, account, [first], "idle")
    two_idle_workers(cluster)
    lost += kill(cluster, account, [second], "the other idle")

    enqueue(job="tests.sleep", account=account.pk, ref="20000/busy")
    busy = wait_for(lambda: TaskRun.objects.filter(ref="20000/busy", outcome=Outcome.RUNNING)
                    .values_list("worker", flat=True).first(), timeout=30, message="the long job to start")
    lost += kill(cluster, account, [int(busy.rsplit(":", 1)[1])], "busy")
    assert lost == ["20000/busy"]

    two_idle_workers(cluster)
    enqueue(job="tests.sleep", account=account.pk, ref="20000/busy-too")
    wait_for(lambda: TaskRun.objects.filter(ref="20000/busy-too", outcome=Outcome.RUNNING).exists(), timeout=30,
             message="the long job to start")
    lost += kill(cluster, account, sorted(workers(cluster)), "both at once")
    assert lost == ["20000/busy", "20000/busy-too"]

    # One slot: the busy worker holds it, and its account's next job waits in line for it.
    two_idle_workers(cluster)
    Budget.objects.filter(account=account).update(max_concurrent=1)
    enqueue(job="tests.sleep", account=account.pk, ref="20000/line-busy")
    busy = wait_for(lambda: TaskRun.objects.filter(ref="20000/line-busy", outcome=Outcome.RUNNING)
                    .values_list("worker", flat=True).first(), timeout=30, message="the long job to start")
    enqueue(job="tests.sleep", account=account.pk, ref="100/line-next")
    wait_for(lambda: DeferredTask.objects.filter(ref="100/line-next").exists(), timeout=10, message="the job to wait in line")
    lost += kill(cluster, account, [int(busy.rsplit(":", 1)[1])], "busy, its account's line waiting", sends=0,
                 waiting="100/line-next")
    assert lost == ["20000/busy", "20000/busy-too", "20000/line-busy"]
    assert "given back at once" in cluster.log()  # not by the reclaim (its lease: 3 s here, checked once a minute)

    wait_for(settled_runs, timeout=60, interval=0.5, message=f"every run to settle; log:\n{cluster.tail(40)}")
    outcomes: dict[str, list[str]] = {}
    for ref, outcome in TaskRun.objects.filter(account=account).order_by("started_at").values_list("ref", "outcome"):
        outcomes.setdefault(ref, []).append(outcome)
    sent = ["100/taken", *(f"100/{label}-{i}" for label in ("idle", "the other idle", "busy", "both at once")
                          for i in range(3)), "20000/busy", "20000/busy-too", "20000/line-busy", "100/line-next"]
    assert sorted(outcomes) == sorted(sent)
    for ref in sent:
        # Killed running: its run is lost; the ORM broker may deliver it again (after `retry`).
        expected = ([[Outcome.LOST], [Outcome.LOST, Outcome.SUCCEEDED]] if ref in lost else [[Outcome.SUCCEEDED]])
        assert outcomes[ref] in expected, (ref, outcomes[ref])
    charged = TaskRun.objects.filter(account=account, outcome__in=CHARGED)
    usage = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert (usage.cpu_used_ms, usage.runs, usage.cpu_reserved_ms) == (
        charged.aggregate(cpu=Sum("cpu_ms"))["cpu"], charged.count(), 0)


@pytest.mark.processes
def test_a_task_started_before_its_run_was_recorded_goes_to_the_next_worker(account, broker, start_cluster,
                                                                          tmp_path):
    """Killed after starting the task (django-q2's pre_execute) and before its run's admission: no
    run of it is recorded, so the tables say it did nothing, and its sentinel hands it on; it runs
    once, in time, on its still dispatched slot."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100_000, max_concurrent=4)
    marker = tmp_path / "before-run"
    cluster = start_cluster("default", **POOL, **broker.env, FAIRSHARE_FAULT="before_run",
                            FAIRSHARE_FAULT_MARKER=str(marker))
    two_idle_workers(cluster)
    enqueue(job="tests.sleep", account=account.pk, ref="100/before-run")
    wait_for(lambda: TaskRun.objects.filter(ref="100/before-run", outcome=Outcome.SUCCEEDED).exists(),
             timeout=STARTS_WITHIN_S, message=f"the task to run on the other worker; log:\n{cluster.tail(40)}")
    assert marker.exists() and "before its run was recorded" in cluster.log()
    wait_for(settled_runs, timeout=30, interval=0.5, message="its slot to be settled")
    assert list(TaskRun.objects.filter(account=account).values_list("ref", "outcome")) == [
        ("100/before-run", Outcome.SUCCEEDED)]
    usage = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert (usage.runs, usage.cpu_reserved_ms) == (1, 0)


@pytest.mark.processes
def test_a_worker_killed_after_its_run_ended_has_its_result_handed_in(account, start_cluster, tmp_path):
    """Killed after its run ended (settled, recorded) and before it handed in the result: its
    sentinel hands the result in for it, so the ORM broker's message is acknowledged now and the
    finished job is not delivered again after `retry`."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100_000, max_concurrent=4)
    marker = tmp_path / "after-settle"
    cluster = start_cluster("default", **POOL, FAIRSHARE_FAULT="after_settle", FAIRSHARE_FAULT_MARKER=str(marker))
    two_idle_workers(cluster)
    enqueue(job="tests.sleep", account=account.pk, ref="100/after-settle")
    wait_for(marker.exists, timeout=30, message=f"the worker to die after its run; log:\n{cluster.tail(40)}")
    wait_for(lambda: not OrmQ.objects.exists(), timeout=STARTS_WITHIN_S,
             message=f"the message to be acknowledged; log:\n{cluster.tail(40)}")
    assert "its result handed in for it" in cluster.log()
    assert list(TaskRun.objects.filter(account=account).values_list("ref", "outcome")) == [
        ("100/after-settle", Outcome.SUCCEEDED)]


def _hold_and_die(lock, held) -> None:
    lock.acquire()
    held.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_guard_stops_waiting_for_a_timer_lock_its_dead_worker_held():
    """A worker killed while holding its timer's lock (handing in a result) must not stop its
    sentinel's guard loop, which takes that lock every cycle: once the worker is dead, the guard
    goes on without it."""
    ctx = multiprocessing.get_context("fork")
    lock, held = TimerLock(), ctx.Event()
    child = ctx.Process(target=_hold_and_die, args=(lock, held))
    child.start()
    assert held.wait(30)
    child.join(30)
    lock.process = child
    guard = threading.Thread(target=lambda: [lock.acquire(), lock.acquire(), lock.release(), lock.release()])
    guard.start()
    guard.join(30)
    assert not guard.is_alive(), "the guard waits for a dead worker's lock"


def test_the_guard_waits_for_a_timer_lock_its_live_worker_holds():
    ctx = multiprocessing.get_context("fork")
    lock, held, done = TimerLock(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=lambda: (lock.acquire(), held.set(), done.wait(30), lock.release()))
    child.start()
    try:
        assert held.wait(30)
        lock.process = child
        got = threading.Event()
        guard = threading.Thread(target=lambda: (lock.acquire(), got.set(), lock.release()), daemon=True)
        guard.start()
        assert not got.wait(0.5)  # the worker lives and holds it: the guard waits
        done.set()
        assert got.wait(30)
    finally:
        done.set()
        child.join(30)


@pytest.mark.processes
def test_a_graceful_stop_runs_what_the_pool_took_and_ends(account, start_cluster):
    """SIGTERM to the main PID: the pool finishes the tasks it had taken (its workers get their
    stop only after them), and every process ends by itself. What it had not taken (still in the
    broker or the holding area when the stop came: a matter of timing) the next cluster runs, once."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100_000, max_concurrent=4)
    cluster = start_cluster("default", **POOL)
    two_idle_workers(cluster)
    refs = [f"300/stop-{i}" for i in range(4)]
    for ref in refs:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)
    wait_for(lambda: TaskRun.objects.filter(outcome=Outcome.RUNNING).exists(), timeout=30, message="work to start")
    cluster.terminate()
    assert cluster.proc.wait(60) == 0, cluster.tail(40)
    assert "has stopped" in cluster.log()
    runs = TaskRun.objects.filter(account=account)
    assert not runs.filter(outcome__in=[Outcome.RUNNING, Outcome.LOST]).exists()  # none cut short or lost
    assert runs.filter(outcome=Outcome.SUCCEEDED).exists()  # at least the run seen going before the stop
    start_cluster("default", **POOL)
    succeeded = runs.filter(outcome=Outcome.SUCCEEDED)
    wait_for(lambda: succeeded.count() >= len(refs), timeout=60, message="the rest to run")
    assert sorted(succeeded.values_list("ref", flat=True)) == refs  # each once
