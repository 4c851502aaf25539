"""A small thread in every worker process that releases due held work about once a second.

django-q2's scheduler ticks every ~30 s; a 2-second retry back-off or a freshly started budget
day should not wait for it. Releasing is idempotent and row-locked (SKIP LOCKED), so several
workers polling at once release each held job once.
"""
import logging
import threading

from django.conf import settings
from django.db import close_old_connections, connections

logger = logging.getLogger("fairshare.releaser")
_started = threading.Event()


def _loop(interval: float) -> None:
    from budgets.services import release_due

    stop = threading.Event()
    while not stop.wait(interval):
        try:
            close_old_connections()
            release_due()
        except Exception as exc:  # the database may be away for a moment; try again next tick
            logger.warning("releasing held work failed: %s", type(exc).__name__)
            connections.close_all()


def start_releaser(**kwargs) -> None:
    """django-q2 `post_spawn` receiver: runs in each freshly started worker process."""
    interval = settings.FAIRSHARE["RELEASE_POLL_S"]
    if interval <= 0 or _started.is_set():
        return
    _started.set()
    threading.Thread(target=_loop, args=(interval,), name="fairshare-releaser", daemon=True).start()
