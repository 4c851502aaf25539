"""Recurring exports: which period a schedule is due for, and requesting it."""
import datetime as dt
import logging
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.db import transaction
from django.utils import timezone

from exports.models import ExportSchedule, SchedulePeriod
from exports.requests import BUILD_JOB, ExportRequestError, export_request
from exports.sources import day_bounds
from scheduling.redaction import describe_error
from scheduling.runtime import enqueue_many

logger = logging.getLogger("fairshare.exports")


def schedule_period(schedule: ExportSchedule, now: dt.datetime) -> tuple[dt.date, dt.date]:
    """The latest period whose run time (`at_time` in the account's zone) has passed."""
    local = now.astimezone(ZoneInfo(schedule.account.timezone))
    today, passed = local.date(), local.time() >= schedule.at_time
    if schedule.period == SchedulePeriod.DAILY:
        run_day = today if passed else today - dt.timedelta(days=1)
        return run_day - dt.timedelta(days=1), run_day - dt.timedelta(days=1)
    if schedule.period == SchedulePeriod.WEEKLY:
        run_day = today - dt.timedelta(days=today.weekday())
        if run_day == today and not passed:
            run_day -= dt.timedelta(days=7)
        return run_day - dt.timedelta(days=7), run_day - dt.timedelta(days=1)
    run_day = today.replace(day=1)
    if run_day == today and not passed:
        run_day = (run_day - dt.timedelta(days=1)).replace(day=1)
    return (run_day - dt.timedelta(days=1)).replace(day=1), run_day - dt.timedelta(days=1)


def run_export_schedules(*, now: dt.datetime | None = None) -> int:
    """Request each active schedule's latest due period; returns how many exports were created.

    The idempotency key names the schedule and the period, so a schedule that fires twice (two
    schedulers, a retry) still makes one export; the export goes through budgets like any other.
    The new exports' builds are enqueued together (`enqueue_many`): the nightly burst is admitted
    or held per account in a few statements.
    """
    now = now or timezone.now()
    created: list[tuple[int, str]] = []
    for schedule in ExportSchedule.objects.filter(is_active=True, account__is_active=True).select_related(
        "account", "requested_by"
    ):
        try:
            created += _run_schedule(schedule, now)  # (account, ref) of the export it created, if any
        except Exception as exc:  # one bad schedule (a zone, a requester) never stops the others
            error_class, message = describe_error(exc)
            logger.error("recurring export failed", extra={"schedule": schedule.pk, "account": schedule.account_id,
                                                           "error_class": error_class, "error": message})
    if created:  # once the records are visible to the workers (at once outside a transaction)
        transaction.on_commit(lambda: enqueue_many(job=BUILD_JOB, work=created))
    return len(created)


def _run_schedule(schedule: ExportSchedule, now: dt.datetime) -> list[tuple[int, str]]:
    try:
        start, end = schedule_period(schedule, now)
    except (ZoneInfoNotFoundError, ValueError):
        logger.warning("recurring export skipped: unknown time zone",
                       extra={"schedule": schedule.pk, "account": schedule.account_id})
        return []
    if day_bounds(start, end)[1] > now:
        # An export's dates are UTC days (sources.day_bounds): east of UTC, the local run time
        # can come before the period's last UTC day is over, and an export requested now would
        # miss the rest of it for good (its key makes it the period's only export). A later
        # tick, once the period is over, requests it.
        return []
    try:
        record, was_created = export_request(
            account_slug=schedule.account.slug, user=schedule.requested_by, start=start, end=end,
            fmt=schedule.format, source=schedule.source,
            idempotency_key=f"schedule-{schedule.pk}-{start.isoformat()}", enqueue=False,
        )
    except ExportRequestError as exc:
        logger.warning("recurring export refused", extra={"schedule": schedule.pk, "code": exc.code})
        return []
    return [(record.account_id, str(record.pk))] if was_created else []
