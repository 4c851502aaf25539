"""A pool's own look at whether it takes its work (scheduling.stuck), what it says to /healthz and to
systemd's watchdog. The real stall, the pool ending itself and its supervisor restarting it are in
test_stall.py; here the rule, case by case, and its false positives."""
import datetime as dt
import socket
from multiprocessing import Value

import pytest
from django.test import Client
from django.utils import timezone

from scheduling import pulse, stuck, watchdog
from scheduling.models import WorkerHeartbeat


class InternalQueue:
    """django-q2's internal queue as the watch reads it: its shared counter of waiting tasks."""

    def __init__(self):
        self.size = type("Counter", (), {"count": Value("i", 0)})()

    def put(self, n: int = 1) -> None:
        self.size.count.value += n


def test_an_idle_worker_that_sees_work_wait_and_takes_none_is_stuck():
    queue = InternalQueue()
    watch = stuck.StuckWatch(queue)
    assert watch.look(now=100) is None  # nothing waits: idle, not stuck
    queue.put()
    assert watch.look(now=101) == 0
    assert watch.look(now=131) == 30


def test_a_worker_busy_with_a_long_task_is_busy_not_stuck():
    queue = InternalQueue()
    watch = stuck.StuckWatch(queue)
    watch.task_started()
    queue.put(4)  # prefetched behind the long task
    assert watch.look(now=1e9) is None
    watch.task_ended()
    assert watch.look() == 0  # the wait starts when the worker is idle again


def test_a_task_started_since_starts_the_wait_again():
    queue = InternalQueue()
    watch = stuck.StuckWatch(queue)
    queue.put(2)
    watch.look(now=0)
    watch.last_start = 5  # took one (and finished it): the pool works
    assert watch.look(now=10) == 0


def test_the_watch_reads_django_q2s_internal_queue_without_its_lock():
    from django_q.queues import Queue

    queue = Queue()
    queue.put("task")
    with queue.size.count.get_lock():  # held, as by a process killed in the middle of a put
        assert stuck.waiting_tasks(queue) == 1
    queue.get()


def heartbeat(worker: str, *, stalled_for: float | None, seen_ago: float = 0) -> None:
    now = timezone.now()
    WorkerHeartbeat.objects.create(
        worker=worker, queue="exports", seen_at=now - dt.timedelta(seconds=seen_ago),
        stalled_since=None if stalled_for is None else now - dt.timedelta(seconds=stalled_for))


@pytest.mark.django_db
@pytest.mark.parametrize("beats, expected", [
    ([("a:1", None)], "ok"),                              # no verdict: nothing waits in the pool
    ([("a:1", 3)], "ok"),                                 # waiting, not yet past the threshold
    ([("a:1", 30)], "stalled: work has waited 30 s in the pool of worker a:1"),
    ([("a:1", 30), ("b:2", None)], "stalled: work has waited 30 s in the pool of worker a:1"),  # two pools
])
def test_healthz_calls_a_queue_stalled_when_a_pool_says_so(settings, beats, expected):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 10}
    for worker, stalled_for in beats:
        heartbeat(worker, stalled_for=stalled_for)
    problem = Client().get("/healthz").json()["checks"]["workers:exports"]
    assert problem.startswith(expected), problem


@pytest.mark.django_db
def test_the_verdict_of_a_pool_that_stopped_beating_is_not_the_restarted_ones(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 10, "WORKER_HEARTBEAT_S": 1,
                          "RELEASE_POLL_S": 0.2}
    heartbeat("old:1", stalled_for=40, seen_ago=5)  # the stuck pool, stopped 5 s ago
    heartbeat("new:2", stalled_for=None)  # the one started in its place
    assert Client().get("/healthz").json()["checks"]["workers:exports"] == "ok"


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(path)
    listener.settimeout(0.5)
    monkeypatch.setenv(watchdog.NOTIFY_SOCKET, path)
    yield listener
    listener.close()


def received(listener) -> list[bytes]:
    got = []
    try:
        while True:
            got.append(listener.recv(64))
    except TimeoutError:
        return got


def test_systemd_gets_a_watchdog_ping_while_the_pool_works(notify_socket, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 10, "STALLED_POOL_EXIT_AFTER_S": 0}
    queue = InternalQueue()
    watch = stuck.StuckWatch(queue)
    assert pulse._watch_the_pool(watch, "exports") is None
    assert received(notify_socket) == [b"WATCHDOG=1"]
    queue.put()
    watch.look()
    watch.waiting_since -= 11  # work has waited 11 s that this idle worker never took
    assert pulse._watch_the_pool(watch, "exports") is not None
    assert received(notify_socket) == []  # silent: systemd restarts the pool after WatchdogSec


def test_without_systemd_nothing_is_sent(monkeypatch):
    monkeypatch.delenv(watchdog.NOTIFY_SOCKET, raising=False)
    assert watchdog.notify() is False
