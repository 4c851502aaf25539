"""The budget clock: which budget day it is, and when the next one starts.

The budget day is a UTC day unless FAIRSHARE["BUDGET_DAY_TIMEZONE"] names another zone. It is read
on the kernel's clock (`scheduling.clock.now`, which only tests may shift: scheduling/testing.py).
"""
import datetime as dt
from zoneinfo import ZoneInfo

from django.conf import settings

from scheduling.clock import now


def _zone() -> ZoneInfo:
    return ZoneInfo(settings.FAIRSHARE["BUDGET_DAY_TIMEZONE"])


def budget_day(at: dt.datetime | None = None) -> dt.date:
    return (at or now()).astimezone(_zone()).date()


def next_reset(at: dt.datetime | None = None) -> dt.datetime:
    """The first instant of the next budget day."""
    day = budget_day(at) + dt.timedelta(days=1)
    return dt.datetime.combine(day, dt.time.min, tzinfo=_zone())
