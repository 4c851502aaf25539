"""Is each queue doing its work? Read by /healthz and /metrics.

A worker's heartbeat is written by its pulse thread, which keeps running while the worker's main
thread is stuck: after an idle worker is SIGKILLed while holding the pool's task-queue lock
(django-q2 upstream issue, see docs/architecture.md "Running workers in production"), the
reincarnated workers beat and never run a task. So a heartbeat only shows that a process exists;
that a pool works is shown by work. A queue is **stalled** when a message has waited longer than
FAIRSHARE["QUEUE_STALL_AFTER_S"], no task of the queue has started since that message was sent,
and no task of the queue is running on a live worker (a pool busy with long tasks is busy, not
stalled).

Two messages are looked at: the oldest in the broker, and (ORM broker) the oldest not fetched by
any cluster. The first catches a stuck pool that fetched the message it cannot run; the second a
stuck pool behind a message an earlier, killed pool fetched and never acknowledged (redelivered
only after `retry`: while a working pool starts tasks after it was sent, it raises no alarm).
"""
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets.models import Queue
from scheduling.models import Outcome, TaskRun, WorkerHeartbeat


def _sent_at(payload) -> dt.datetime | None:
    try:
        return SignedPackage.loads(payload)["started"]
    except Exception:
        return None


def _oldest_sent(queue: str, broker) -> tuple[dt.datetime | None, dt.datetime | None]:
    """When the oldest message in `queue` was sent, and the oldest not fetched by a cluster yet
    (ORM and Redis brokers; a Redis message leaves the list when it is fetched)."""
    if isinstance(broker, ORM):  # also the FifoORM subclass configured in settings
        messages = OrmQ.objects.filter(key=queue).order_by("id").values_list("payload", flat=True)
        oldest = messages.first()
        available = messages.filter(lock__lt=timezone.now()).first()
        return (_sent_at(oldest) if oldest else None), (_sent_at(available) if available else None)
    if broker.__class__.__name__ == "Redis":
        oldest = broker.connection.lindex(broker.list_key, 0)
        sent = _sent_at(oldest) if oldest else None
        return sent, sent
    return None, None


def _live_workers() -> dict[str, list[str]]:
    """Worker ids (host:pid) per queue heard from within FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"]."""
    since = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
    workers: dict[str, list[str]] = {}
    for worker, queue in WorkerHeartbeat.objects.filter(seen_at__gte=since).values_list("worker", "queue"):
        workers.setdefault(queue, []).append(worker)
    return workers


@dataclass(frozen=True)
class QueueHealth:
    queue: str
    depth: int  # messages waiting to be fetched
    oldest_age_s: float  # the oldest message still in the broker; 0 when there is none
    workers: int  # live worker processes (by heartbeat)
    # Seconds since a task of this queue last started (None: never, or not looked up - it is
    # looked up only when a message has waited longer than the stall threshold).
    idle_s: float | None
    busy: bool  # a task of this queue is running on a live worker
    stalled: bool


def _health(queue: str, workers: list[str], now: dt.datetime, stall_after: float) -> QueueHealth:
    broker = get_broker(queue)
    oldest, available = _oldest_sent(queue, broker)
    waiting = [sent for sent in (oldest, available) if sent and (now - sent).total_seconds() > stall_after]
    idle_s, busy, stalled = None, False, False
    if waiting:
        runs = TaskRun.objects.filter(queue=queue)
        last_start = runs.order_by("-started_at").values_list("started_at", flat=True).first()
        idle_s = (now - last_start).total_seconds() if last_start else None
        busy = runs.filter(outcome=Outcome.RUNNING, worker__in=workers).exists()
        stalled = not busy and any(last_start is None or last_start < sent for sent in waiting)
    return QueueHealth(queue=queue, depth=broker.queue_size() or 0,
                       oldest_age_s=(now - oldest).total_seconds() if oldest else 0.0,
                       workers=len(workers), idle_s=idle_s, busy=busy, stalled=stalled)


def queue_health() -> list[QueueHealth]:
    now = timezone.now()
    workers = _live_workers()
    stall_after = settings.FAIRSHARE["QUEUE_STALL_AFTER_S"]
    return [_health(queue, workers.get(queue, []), now, stall_after) for queue in Queue.values]


def queue_problem(health: QueueHealth) -> str | None:
    """What /healthz says about a queue's workers, or None when they are fine."""
    if not health.workers:
        return f"no worker heard from in {settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s"
    if health.stalled:
        idle = "no task has ever started" if health.idle_s is None else f"no task started for {health.idle_s:.0f} s"
        return (f"stalled: a message has waited {health.oldest_age_s:.0f} s and {idle} "
                f"while {health.workers} worker(s) report alive; restart the pool")
    return None
