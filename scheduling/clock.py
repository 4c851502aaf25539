"""The kernel's clock: what time the holding area, the budgets and their tests agree it is.

FAIRSHARE["CLOCK_OFFSET_S"] shifts this clock (only this one) so tests can move a set of real
worker processes to "tomorrow"; it is a test-only seam (scheduling/testing.py), 0 in production. Leases, TaskRun times and
everything else stamped by the database stay on the real clock.

It is also the process's alarm clock: a moment something here waits for (a line held up until
then, scheduling.holding.block) ends the pulse's `doze` by then, so that a rate limit's window that
frees within the second is not left to wait for the next whole tick.
"""
import datetime as dt
import threading
import time

from django.conf import settings
from django.utils import timezone


def now() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["CLOCK_OFFSET_S"])


_alarm = threading.Condition()
_alarm_at: float | None = None  # time.monotonic() of the earliest alarm set and not yet come


def set_alarm(at: dt.datetime) -> None:
    """Someone in this process waits for `at` (this clock's time): a `doze` ends by then."""
    global _alarm_at
    due = time.monotonic() + max(0.0, (at - now()).total_seconds())
    with _alarm:
        if _alarm_at is None or due < _alarm_at:
            _alarm_at = due
            _alarm.notify_all()


def doze(seconds: float) -> None:
    """Sleep `seconds`, or less: until the earliest alarm set in this process (`set_alarm`) comes."""
    global _alarm_at
    deadline = time.monotonic() + seconds
    with _alarm:
        while (left := (deadline if _alarm_at is None else min(deadline, _alarm_at)) - time.monotonic()) > 0:
            _alarm.wait(left)
        if _alarm_at is not None and _alarm_at <= time.monotonic():
            _alarm_at = None


def from_wall(moment: dt.datetime | None) -> dt.datetime | None:
    """A moment on the wall clock (a TaskRun's times) as this clock tells it."""
    return None if moment is None else moment + dt.timedelta(seconds=settings.FAIRSHARE["CLOCK_OFFSET_S"])
