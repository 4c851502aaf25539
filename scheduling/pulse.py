"""The pulse: a small thread in every worker process that releases due held work about once a
second and writes the worker's heartbeat (WorkerHeartbeat) every few seconds.

django-q2's scheduler ticks every ~30 s; a 2-second retry back-off or a freshly started budget
day should not wait for it. Releasing is idempotent and row-locked (SKIP LOCKED), so several
workers pulsing at once release each held job once.
"""
import logging
import threading
import time

from django.conf import settings
from django.db import connections
from django.utils import timezone

logger = logging.getLogger("fairshare.pulse")
_started = threading.Event()


def write_heartbeat(queue: str) -> None:
    from scheduling.models import WorkerHeartbeat
    from scheduling.services import worker_id

    WorkerHeartbeat.objects.update_or_create(worker=worker_id(), defaults={"queue": queue, "seen_at": timezone.now()})


def _loop(interval: float, queue: str) -> None:
    from scheduling.holding import release_due
    from scheduling.runtime import close_old_connections

    every = settings.FAIRSHARE["WORKER_HEARTBEAT_S"]
    last_heartbeat = 0.0
    while True:
        try:
            close_old_connections()
            if time.monotonic() - last_heartbeat >= every:
                write_heartbeat(queue)
                last_heartbeat = time.monotonic()
            release_due()
        except Exception as exc:  # the database may be away for a moment; try again next tick
            logger.warning("worker pulse failed", extra={"error_class": type(exc).__name__})
            connections.close_all()
        time.sleep(interval)


def start_pulse(**kwargs) -> None:
    """django-q2 `post_spawn` receiver: runs in each freshly started worker process."""
    from django_q.conf import Conf

    interval = settings.FAIRSHARE["RELEASE_POLL_S"]
    if interval <= 0 or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_loop, args=(interval, Conf.CLUSTER_NAME), name="fairshare-pulse", daemon=True).start()
