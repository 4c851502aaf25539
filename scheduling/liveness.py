"""Is each queue doing its work? Read by /healthz and /metrics; how many workers run on a queue
(`heard_since`) also by the enqueue check, which sends no more than they could start.

A worker's heartbeat is written by its pulse thread, which keeps running while the worker's main
thread waits for work its pool no longer hands out (a killed worker does not do that any more,
scheduling.pool; this is the backstop for what nobody foresaw, docs/architecture.md "Running
workers in production"). So a heartbeat only shows that a process exists;
that a pool works is shown by work started. A queue is **stalled** when either

- a live worker reports that work has waited in its pool for longer than
  FAIRSHARE["QUEUE_STALL_AFTER_S"] and it, idle all along, started none of it
  (`WorkerHeartbeat.stalled_since`, from the pool's own look: scheduling.stuck). Whether the
  message was fetched does not matter: the work is inside the pool and nobody starts it. Or
- a message that no cluster has fetched has waited longer than that in the broker, no task of the
  queue has started since it was sent, and none is running on a live worker (a pool busy with long
  tasks is busy, not stalled): the view from outside, for a pool that cannot look at itself.

Messages fetched by a pool that was killed are in no pool: they stay in the ORM broker until
`retry` redelivers them, a restart cannot speed that up, and so they raise no alarm (the
reconciler re-sends the exports among them).
"""
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone
from django_q.brokers import get_broker
from django_q.brokers.orm import ORM
from django_q.brokers.redis_broker import Redis
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
    """When the oldest message in `queue` was sent, and the oldest no cluster has fetched yet
    (ORM and Redis brokers; a Redis message leaves the list when it is fetched). RabbitMQ has no
    look at a queue's head that takes nothing (a get would redeliver it): none, so on RabbitMQ only
    the pools' own verdict (scheduling.stuck) calls a queue stalled."""
    if isinstance(broker, ORM):  # also the FifoORM subclass configured in settings
        messages = OrmQ.objects.filter(key=queue).order_by("id").values_list("payload", flat=True)
        oldest = messages.first()
        waiting = messages.filter(lock__lt=timezone.now()).first()
        return (_sent_at(oldest) if oldest else None), (_sent_at(waiting) if waiting else None)
    if isinstance(broker, Redis):  # also the VerifiedRedis subclass configured in settings
        oldest = broker.connection.lindex(broker.list_key, 0)
        sent = _sent_at(oldest) if oldest else None
        return sent, sent
    return None, None


@dataclass(frozen=True)
class LiveWorker:
    worker: str  # host:pid
    seen_at: dt.datetime
    stalled_since: dt.datetime | None  # its pool's own verdict (scheduling.stuck)


def live_since(now: dt.datetime) -> dt.datetime:
    """Heartbeats at or after this time are of workers running now: two heartbeats and a tick of
    the pulse (a worker killed within it still counts until it is over)."""
    options = settings.FAIRSHARE
    return now - dt.timedelta(seconds=2 * options["WORKER_HEARTBEAT_S"] + options["RELEASE_POLL_S"])


def heard_since() -> dt.datetime | None:
    """The heartbeats that count a queue's running workers (`live_since` now; the enqueue check's
    question, budgets.ledger.idle_workers, which counts them); None when workers run no pulse
    (FAIRSHARE["RELEASE_POLL_S"] 0: no heartbeat says anything)."""
    if settings.FAIRSHARE["RELEASE_POLL_S"] <= 0:
        return None
    return live_since(timezone.now())


def _live_workers() -> dict[str, list[LiveWorker]]:
    """Workers per queue heard from within FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"]."""
    since = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
    workers: dict[str, list[LiveWorker]] = {}
    for worker, queue, seen_at, stalled_since in WorkerHeartbeat.objects.filter(seen_at__gte=since).values_list(
            "worker", "queue", "seen_at", "stalled_since"):
        workers.setdefault(queue, []).append(LiveWorker(worker, seen_at, stalled_since))
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
    # The worker that reports its pool stuck the longest, and for how long (None: none does).
    stuck_worker: str | None = None
    stuck_s: float | None = None


def _stuck_pool(workers: list[LiveWorker], now: dt.datetime, stall_after: float) -> tuple[str | None, float | None]:
    """The live worker whose pool has been stuck the longest, if longer than `stall_after`.

    A verdict counts while its worker beats (two heartbeats and a tick): a stuck pool that was
    stopped or ended itself is not the one its supervisor started again."""
    current = live_since(now)
    reports = sorted((w.stalled_since, w.worker) for w in workers if w.stalled_since and w.seen_at >= current)
    if reports and (now - reports[0][0]).total_seconds() > stall_after:
        return reports[0][1], (now - reports[0][0]).total_seconds()
    return None, None


def _health(queue: str, workers: list[LiveWorker], now: dt.datetime, stall_after: float) -> QueueHealth:
    broker = get_broker(queue)
    oldest, waiting = _oldest_sent(queue, broker)
    idle_s, busy, stalled = None, False, False
    stuck_worker, stuck_s = _stuck_pool(workers, now, stall_after)
    if waiting and (now - waiting).total_seconds() > stall_after:
        runs = TaskRun.objects.filter(queue=queue)
        last_start = runs.order_by("-started_at").values_list("started_at", flat=True).first()
        idle_s = (now - last_start).total_seconds() if last_start else None
        busy = runs.filter(outcome=Outcome.RUNNING, worker__in=[w.worker for w in workers]).exists()
        stalled = not busy and (last_start is None or last_start < waiting)
    return QueueHealth(queue=queue, depth=broker.queue_size() or 0,
                       oldest_age_s=(now - oldest).total_seconds() if oldest else 0.0,
                       workers=len(workers), idle_s=idle_s, busy=busy, stalled=stalled or stuck_worker is not None,
                       stuck_worker=stuck_worker, stuck_s=stuck_s)


def queue_health() -> list[QueueHealth]:
    now = timezone.now()
    workers = _live_workers()
    stall_after = settings.FAIRSHARE["QUEUE_STALL_AFTER_S"]
    return [_health(queue, workers.get(queue, []), now, stall_after) for queue in Queue.values]


def queue_problem(health: QueueHealth) -> str | None:
    """What /healthz says about a queue's workers, or None when they are fine."""
    if not health.workers:
        return f"no worker heard from in {settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s"
    if health.stuck_worker:
        return (f"stalled: work has waited {health.stuck_s:.0f} s in the pool of worker {health.stuck_worker} and no "
                f"idle worker of it takes it; restart the pool (it ends itself after "
                f"{settings.FAIRSHARE['STALLED_POOL_EXIT_AFTER_S']:g} s unless that is 0)")
    if health.stalled:
        idle = "no task has ever started" if health.idle_s is None else f"no task started for {health.idle_s:.0f} s"
        return (f"stalled: messages wait, the oldest for {health.oldest_age_s:.0f} s, and {idle} "
                f"while {health.workers} worker(s) report alive; restart the pool")
    return None
