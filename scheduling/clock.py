"""The kernel's clock: what time the holding area, the budgets and their tests agree it is.

FAIRSHARE["CLOCK_OFFSET_S"] shifts this clock (only this one) so tests can move a set of real
worker processes to "tomorrow"; it is a test-only seam (scheduling/testing.py), 0 in production. Leases, TaskRun times and
everything else stamped by the database stay on the real clock.
"""
import datetime as dt

from django.conf import settings
from django.utils import timezone


def now() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["CLOCK_OFFSET_S"])


def from_wall(moment: dt.datetime | None) -> dt.datetime | None:
    """A moment on the wall clock (a TaskRun's times) as this clock tells it."""
    return None if moment is None else moment + dt.timedelta(seconds=settings.FAIRSHARE["CLOCK_OFFSET_S"])
