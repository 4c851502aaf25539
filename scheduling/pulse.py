"""The pulse: a small thread in every worker process that releases due held work about once a
second, writes the worker's heartbeat (WorkerHeartbeat) every few seconds, and watches whether the
worker's pool still takes its work (scheduling.stuck): it says so with the heartbeat, pings
systemd's watchdog while the pool works (scheduling.watchdog), and ends a pool stuck for
FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"] so that its supervisor starts it again.

django-q2's scheduler ticks every ~30 s; a 2-second retry back-off or a freshly started budget
day should not wait for it, nor a line held up until sooner than the next tick (a rate limit's
window frees within the second): the pulse ticks at that time instead (`_until_next_tick`, and
scheduling.clock's alarm for lines held up in this process). Releasing is idempotent and
row-locked (SKIP LOCKED), so several workers pulsing at once release each held job once.
"""
import datetime as dt
import logging
import threading
import time

from django.conf import settings
from django.db import connections
from django.utils import timezone

from scheduling import clock, stuck, watchdog

logger = logging.getLogger("fairshare.pulse")
_started = threading.Event()
# The shortest wait between two ticks, however soon the next held-up line's time comes.
MIN_TICK_S = 0.02


def write_heartbeat(queue: str, *, stalled_since: dt.datetime | None = None) -> None:
    from scheduling.models import WorkerHeartbeat
    from scheduling.services import worker_id

    WorkerHeartbeat.objects.update_or_create(
        worker=worker_id(), defaults={"queue": queue, "seen_at": timezone.now(), "stalled_since": stalled_since})


def _watch_the_pool(watch: stuck.StuckWatch | None, queue: str) -> dt.datetime | None:
    """One look at the pool: ping the watchdog while it works, end it once stuck for too long.
    Returns since when it has been stuck (None: it works). No database query."""
    stuck_s = watch.look() if watch else None
    if stuck_s is None or stuck_s < settings.FAIRSHARE["QUEUE_STALL_AFTER_S"]:
        watchdog.notify()
    if stuck_s is None:
        return None
    exit_after = settings.FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"]
    if exit_after and stuck_s >= exit_after:
        stuck.exit_pool(queue=queue, stuck_s=stuck_s)
    return timezone.now() - dt.timedelta(seconds=stuck_s)


def _until_next_tick(interval: float) -> float:
    """`interval`, or less when the first held-up line's time comes sooner (one index entry)."""
    from scheduling.holding import next_unblock

    until = next_unblock()
    if until is None:
        return interval
    return min(interval, max(MIN_TICK_S, (until - clock.now()).total_seconds()))


def _loop(interval: float, queue: str, watch: stuck.StuckWatch | None) -> None:
    from scheduling.holding import release_due
    from scheduling.connections import close_old_connections

    every = settings.FAIRSHARE["WORKER_HEARTBEAT_S"]
    last_heartbeat = 0.0
    while True:
        stalled_since = _watch_the_pool(watch, queue)
        pause = interval
        try:
            close_old_connections()
            if time.monotonic() - last_heartbeat >= every:
                write_heartbeat(queue, stalled_since=stalled_since)
                last_heartbeat = time.monotonic()
            # Held work goes to the broker only for a worker that is idle (this one, when it is):
            # busy workers take it by hand-off and pull, in the fair order.
            release_due(idle_workers=None if watch is None else {queue: int(watch.wants_work())})
            pause = _until_next_tick(interval)
        except Exception as exc:  # the database may be away for a moment; try again next tick
            module = {"module": exc.name} if isinstance(exc, ImportError) else {}  # a name, not data
            logger.warning("worker pulse failed", extra={"error_class": type(exc).__name__, **module})
            connections.close_all()
        clock.doze(pause)  # or less: until a line held up in this process may go


def _watch() -> stuck.StuckWatch | None:
    """This worker's StuckWatch, fed by django-q2's task signals; None when its internal queue
    cannot be read (then the pool is judged from outside only: scheduling.liveness)."""
    from django_q.signals import post_execute_in_worker, pre_execute

    queue = stuck.internal_queue()
    try:
        stuck.waiting_tasks(queue)
    except Exception:
        logger.warning("stuck-pool watch off in this worker: django-q2's internal queue cannot be read")
        return None
    watch = stuck.StuckWatch(queue)
    pre_execute.connect(watch.task_started, dispatch_uid="fairshare.stuck.started")
    post_execute_in_worker.connect(watch.task_ended, dispatch_uid="fairshare.stuck.ended")
    return watch


def start_pulse(**kwargs) -> None:
    """django-q2 `post_spawn` receiver: runs in each freshly started worker process."""
    from django_q.conf import Conf

    interval = settings.FAIRSHARE["RELEASE_POLL_S"]
    if interval <= 0 or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_loop, args=(interval, Conf.CLUSTER_NAME, _watch()), name="fairshare-pulse",
                     daemon=True).start()
