"""A small thread in every worker process: releases due held work about once a second, and says
the worker is alive (WorkerHeartbeat) every few seconds.

django-q2's scheduler ticks every ~30 s; a 2-second retry back-off or a freshly started budget
day should not wait for it. Releasing is idempotent and row-locked (SKIP LOCKED), so several
workers polling at once release each held job once.
"""
import logging
import threading
import time

from django.conf import settings
from django.db import connections
from django.utils import timezone

logger = logging.getLogger("fairshare.releaser")
_started = threading.Event()


def beat(queue: str) -> None:
    from scheduling.models import WorkerHeartbeat
    from scheduling.services import worker_id

    WorkerHeartbeat.objects.update_or_create(worker=worker_id(), defaults={"queue": queue, "seen_at": timezone.now()})


def _loop(interval: float, queue: str) -> None:
    from budgets.services import release_due
    from scheduling.runtime import close_old_connections

    every = settings.FAIRSHARE["WORKER_HEARTBEAT_S"]
    last_beat = 0.0
    while True:
        try:
            close_old_connections()
            if time.monotonic() - last_beat >= every:
                beat(queue)
                last_beat = time.monotonic()
            release_due()
        except Exception as exc:  # the database may be away for a moment; try again next tick
            logger.warning("worker pulse failed", extra={"error_class": type(exc).__name__})
            connections.close_all()
        time.sleep(interval)


def start_releaser(**kwargs) -> None:
    """django-q2 `post_spawn` receiver: runs in each freshly started worker process."""
    from django_q.conf import Conf

    interval = settings.FAIRSHARE["RELEASE_POLL_S"]
    if interval <= 0 or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_loop, args=(interval, Conf.CLUSTER_NAME), name="fairshare-pulse", daemon=True).start()
