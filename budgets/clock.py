"""The budget clock: which budget day it is, and when the next one starts.

The budget day is a UTC day unless FAIRSHARE["BUDGET_DAY_TIMEZONE"] names another zone.
FAIRSHARE["CLOCK_OFFSET_S"] shifts this clock (only this one) so rehearsals and tests can move a
set of real worker processes to "tomorrow"; it is 0 in production.
"""
import datetime as dt
from zoneinfo import ZoneInfo

from django.conf import settings
from django.utils import timezone


def now() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["CLOCK_OFFSET_S"])


def _zone() -> ZoneInfo:
    return ZoneInfo(settings.FAIRSHARE["BUDGET_DAY_TIMEZONE"])


def budget_day(at: dt.datetime | None = None) -> dt.date:
    return (at or now()).astimezone(_zone()).date()


def next_reset(at: dt.datetime | None = None) -> dt.datetime:
    """The first instant of the next budget day."""
    day = budget_day(at) + dt.timedelta(days=1)
    return dt.datetime.combine(day, dt.time.min, tzinfo=_zone())
