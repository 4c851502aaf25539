"""Requesting an export: the scope checks, the idempotency key, and enqueueing the build."""
import datetime as dt
import logging

from django.conf import settings
from django.db import IntegrityError, transaction

from budgets.models import Account
from budgets.tenancy import can_export, membership_of
from exports.models import ExportFormat, ExportRecord
from exports.sources import EARLIEST_DATE, LATEST_DATE, SOURCES, day_bounds, get_source
from scheduling.runtime import enqueue_on_commit

logger = logging.getLogger("fairshare.exports")

# The job that builds an export (exports/jobs.py); a request enqueues it with the export id as ref.
BUILD_JOB = "exports.build"


class ExportRequestError(Exception):
    """A request that cannot be accepted; nothing was created. `code` is stable for API clients."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def _scope_matches(record: ExportRecord, *, start, end, fmt, source) -> bool:
    return (record.start_date, record.end_date, record.format, record.source) == (start, end, fmt, source)


def _existing_for_key(*, account: Account, key: str, start, end, fmt, source) -> ExportRecord | None:
    record = ExportRecord.objects.filter(account=account, idempotency_key=key).first()
    if record is not None and not _scope_matches(record, start=start, end=end, fmt=fmt, source=source):
        raise ExportRequestError(
            "idempotency_key_reused",
            "This idempotency key was already used for an export with a different scope.",
        )
    return record


def _checked_account(*, account_slug: str, user, start: dt.date, end: dt.date, fmt: str, source: str) -> Account:
    """The account to export, once the requester and the scope pass every check, in this order
    (API clients see the first failing check's code)."""
    account = Account.objects.filter(slug=account_slug).first()
    if account is None:
        raise ExportRequestError("unknown_account", f"No account {account_slug!r}.")
    if user is None or (membership_of(user=user, account=account) is None and not user.is_superuser):
        raise ExportRequestError("not_member", f"You are not a member of account {account_slug!r}.")
    if not can_export(user=user, account=account):
        raise ExportRequestError("not_allowed", "Your role in this account does not allow exports.")
    if not account.is_active:
        raise ExportRequestError("account_inactive", f"Account {account_slug!r} is not active.")
    if fmt not in ExportFormat.values:
        raise ExportRequestError("unsupported_format", f"Unsupported format {fmt!r}; supported: {', '.join(ExportFormat.values)}.")
    if source not in SOURCES:
        raise ExportRequestError("unknown_source", f"Unknown source {source!r}; known: {', '.join(sorted(SOURCES))}.")
    if not (EARLIEST_DATE <= start <= LATEST_DATE and EARLIEST_DATE <= end <= LATEST_DATE):
        raise ExportRequestError("date_out_of_range", f"Dates must lie from {EARLIEST_DATE} to {LATEST_DATE}.")
    if start > end:
        raise ExportRequestError("invalid_range", "The start date is after the end date.")
    max_days = settings.FAIRSHARE["EXPORT_MAX_RANGE_DAYS"]
    if (end - start).days + 1 > max_days:
        raise ExportRequestError("range_too_large", f"The range spans more than {max_days} days.")
    return account


def export_request(
    *,
    account_slug: str,
    user,
    start: dt.date,
    end: dt.date,
    fmt: str = ExportFormat.CSV,
    source: str = "activity",
    idempotency_key: str | None = None,
    enqueue: bool = True,
) -> tuple[ExportRecord, bool]:
    """Validate the input scope and create a queued export; returns (export, created).

    A repeated idempotency key returns the existing export (created=False), also when two
    requests race: the unique constraint decides, not a check-then-insert. With enqueue=False
    the caller enqueues the build itself (a batch: `scheduling.runtime.enqueue_many`); a record
    whose build was never enqueued is re-enqueued by the reconciler.
    """
    account = _checked_account(account_slug=account_slug, user=user, start=start, end=end, fmt=fmt, source=source)
    if idempotency_key:
        existing = _existing_for_key(account=account, key=idempotency_key, start=start, end=end, fmt=fmt, source=source)
        if existing is not None:
            return existing, False

    since, until = day_bounds(start, end)
    estimate = get_source(source).base_queryset(account_id=account.pk, since=since, until=until).count()
    max_rows = settings.FAIRSHARE["EXPORT_MAX_ROWS"]
    if estimate > max_rows:
        raise ExportRequestError("too_many_rows", f"The range holds {estimate} rows; the maximum is {max_rows}.")

    try:
        with transaction.atomic():
            record = ExportRecord.objects.create(
                account=account, requested_by=user, start_date=start, end_date=end, format=fmt,
                source=source, idempotency_key=idempotency_key or None, rows_estimated=estimate,
            )
            if enqueue:
                enqueue_on_commit(job=BUILD_JOB, account=account.pk, ref=str(record.pk))
    except IntegrityError:
        # A concurrent request with the same key won the insert.
        if not idempotency_key:
            raise
        existing = _existing_for_key(account=account, key=idempotency_key, start=start, end=end, fmt=fmt, source=source)
        if existing is None:
            raise
        return existing, False
    logger.info("export requested", extra={"export": str(record.pk), "account": account.pk})
    return record, True
