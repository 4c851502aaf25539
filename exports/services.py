"""Writes of the exports app: requesting an export and the attempt that builds it."""
import datetime as dt
import logging
import tempfile
from dataclasses import dataclass
from uuid import UUID

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from budgets.limits import BudgetExhausted, RunBudget, UnlimitedBudget
from budgets.metering import Meter
from budgets.models import Account
from budgets.selectors import can_export, membership_of
from exports import storage
from exports.models import AttemptOutcome, ExportAttempt, ExportFormat, ExportRecord, ExportStatus
from exports.sources import SOURCES, day_bounds, get_source
from exports.streaming import stream_csv
from scheduling.models import Outcome, TaskRun
from scheduling.redaction import describe_error
from scheduling.runtime import enqueue_on_commit

logger = logging.getLogger("fairshare.exports")

BUILD_JOB = "exports.build"


class ExportRequestError(Exception):
    """A request that cannot be accepted; nothing was created. `code` is stable for API clients."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# --- Requesting ------------------------------------------------------------------------------

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


def export_request(
    *,
    account_slug: str,
    user,
    start: dt.date,
    end: dt.date,
    fmt: str = ExportFormat.CSV,
    source: str = "activity",
    idempotency_key: str | None = None,
) -> tuple[ExportRecord, bool]:
    """Validate the input scope and create a queued export; returns (export, created).

    A repeated idempotency key returns the existing export (created=False), also when two
    requests race: the unique constraint decides, not a check-then-insert.
    """
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
    if start > end:
        raise ExportRequestError("invalid_range", "The start date is after the end date.")
    max_days = settings.FAIRSHARE["EXPORT_MAX_RANGE_DAYS"]
    if (end - start).days + 1 > max_days:
        raise ExportRequestError("range_too_large", f"The range spans more than {max_days} days.")

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


# --- Building (one attempt) ------------------------------------------------------------------

class ExportSuperseded(Exception):
    """This attempt no longer owns the export (lease lost, or the export was finished meanwhile)."""


class ExportNotAuthorised(Exception):
    """The export may no longer be built (account deactivated, requester lost the right)."""


@dataclass(frozen=True)
class BuildResult:
    outcome: str  # a scheduling Outcome
    rows: int = 0


def _lease_expiry() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["EXPORT_LEASE_S"])


def export_claim(*, export_id: UUID, account_id: int, owner: str, task_run: TaskRun | None) -> ExportAttempt | None:
    """Start a new attempt: queued (or running with an expired lease) -> running, new epoch.

    Returns None, with no side effects, when there is nothing to claim.
    """
    with transaction.atomic():
        # Row lock: two deliveries of the same envelope must not both claim the same epoch.
        record = ExportRecord.objects.select_for_update().filter(pk=export_id, account_id=account_id).first()
        if record is None:
            return None
        now = timezone.now()
        lease_expired = record.lease_expires_at is not None and record.lease_expires_at <= now
        if not (record.status == ExportStatus.QUEUED or (record.status == ExportStatus.RUNNING and lease_expired)):
            return None
        if record.attempt_count >= record.attempt_limit:
            ExportRecord.objects.filter(pk=record.pk).update(
                status=ExportStatus.FAILED, error_class="AttemptsExhausted",
                error_message=f"gave up after {record.attempt_count} attempts", completed_at=Now(),
            )
            return None
        epoch = record.lease_epoch + 1
        ExportRecord.objects.filter(pk=record.pk).update(
            status=ExportStatus.RUNNING, attempt_count=F("attempt_count") + 1, lease_epoch=epoch,
            lease_owner=owner, lease_expires_at=_lease_expiry(), started_at=Coalesce("started_at", Now()),
            rows_written=0,
        )
        # A previous attempt still marked running lost its lease (its worker died or stalled).
        record.attempts.filter(outcome=AttemptOutcome.RUNNING).update(
            outcome=AttemptOutcome.SUPERSEDED, finished_at=Now(),
        )
        return ExportAttempt.objects.create(
            export=record, number=record.attempt_count + 1, epoch=epoch, task_run=task_run, worker=owner,
        )


def export_heartbeat(*, export_id: UUID, epoch: int, rows_written: int) -> None:
    """Report progress and renew the lease; raise ExportSuperseded if this attempt lost it."""
    # Guarded by the epoch: only the attempt that owns the lease may move the record.
    renewed = ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch,
    ).update(rows_written=rows_written, lease_expires_at=_lease_expiry())
    if not renewed:
        raise ExportSuperseded(f"attempt with epoch {epoch} no longer owns export {export_id}")


def export_complete(*, export_id: UUID, epoch: int, key: str, rows: int, byte_size: int, checksum: str) -> bool:
    # Guarded by the lease epoch: a stale attempt that lost its lease must not win.
    retention = dt.timedelta(days=settings.FAIRSHARE["EXPORT_RETENTION_DAYS"])
    return ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch,
    ).update(
        status=ExportStatus.SUCCEEDED, output_key=key, row_count=rows, rows_written=rows,
        byte_size=byte_size, checksum_sha256=checksum, completed_at=Now(),
        expires_at=timezone.now() + retention, lease_expires_at=None, error_class="", error_message="",
    ) == 1


def export_requeue(*, export_id: UUID, epoch: int) -> bool:
    """Give the claim back (the run was stopped by the budget cap): queued again, and the attempt
    it spent is returned — waiting for budget never uses up an export's attempts."""
    return ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch,
    ).update(
        status=ExportStatus.QUEUED, attempt_count=F("attempt_count") - 1, lease_expires_at=None, rows_written=0,
    ) == 1


def export_fail(*, export_id: UUID, epoch: int, error: BaseException) -> bool:
    error_class, message = describe_error(error)
    return ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch,
    ).update(
        status=ExportStatus.FAILED, error_class=error_class, error_message=message,
        completed_at=Now(), lease_expires_at=None,
    ) == 1


def _attempt_finish(attempt: ExportAttempt, *, outcome: str, rows: int, error: BaseException | None = None) -> None:
    error_class, message = describe_error(error) if error is not None else ("", "")
    ExportAttempt.objects.filter(pk=attempt.pk).update(
        outcome=outcome, rows_written=rows, error_class=error_class, error_message=message, finished_at=Now(),
    )


def _authorise(record: ExportRecord) -> None:
    account = record.account
    if not account.is_active:
        raise ExportNotAuthorised("the account is not active")
    if record.requested_by is not None and not can_export(user=record.requested_by, account=account):
        raise ExportNotAuthorised("the requester may no longer export this account")


def export_build(
    *, export_id: UUID, account_id: int, owner: str, meter: Meter, task_run: TaskRun | None = None,
    budget: RunBudget | None = None,
) -> BuildResult:
    """One attempt: claim, stream to a temporary file, publish under the export's key, complete.

    Between batches it renews its lease and checks the run's CPU budget (raising BudgetExhausted,
    which the budget middleware turns into a hold until the next budget day)."""
    budget = budget or UnlimitedBudget()
    attempt = export_claim(export_id=export_id, account_id=account_id, owner=owner, task_run=task_run)
    if attempt is None:
        return BuildResult(outcome=Outcome.SKIPPED)
    record = attempt.export
    epoch = attempt.epoch
    rows = 0

    def on_batch(rows_so_far: int) -> None:
        nonlocal rows
        rows = rows_so_far
        export_heartbeat(export_id=record.pk, epoch=epoch, rows_written=rows_so_far)
        budget.check()

    try:
        _authorise(record)
        since, until = day_bounds(record.start_date, record.end_date)
        key = storage.object_key(account_id=record.account_id, export_id=record.pk)
        with tempfile.TemporaryFile(prefix="fairshare-export-") as tmp:
            result = stream_csv(
                source=get_source(record.source), account_id=record.account_id, since=since, until=until,
                out=tmp, meter=meter, on_batch=on_batch,
            )
            rows = result.rows
            tmp.flush()
            # Fence before the side effect: don't publish for an attempt that lost its lease.
            export_heartbeat(export_id=record.pk, epoch=epoch, rows_written=rows)
            storage.publish(key=key, fileobj=tmp, meter=meter)
        if not export_complete(
            export_id=record.pk, epoch=epoch, key=key, rows=result.rows,
            byte_size=result.byte_size, checksum=result.sha256,
        ):
            raise ExportSuperseded(f"attempt with epoch {epoch} was fenced out at completion")
    except ExportSuperseded:
        _attempt_finish(attempt, outcome=AttemptOutcome.SUPERSEDED, rows=rows)
        return BuildResult(outcome=Outcome.SKIPPED, rows=rows)
    except BudgetExhausted:
        export_requeue(export_id=record.pk, epoch=epoch)
        _attempt_finish(attempt, outcome=AttemptOutcome.BUDGET_EXHAUSTED, rows=rows)
        raise
    except BaseException as exc:
        try:
            export_fail(export_id=record.pk, epoch=epoch, error=exc)
            _attempt_finish(attempt, outcome=AttemptOutcome.FAILED, rows=rows, error=exc)
        except Exception:
            # The database itself may be what failed. The record keeps its lease, which expires,
            # and the export can be claimed again; the original error is what we report.
            logger.warning("could not record the failure of export %s", record.pk)
        raise
    _attempt_finish(attempt, outcome=AttemptOutcome.SUCCEEDED, rows=result.rows)
    logger.info("export completed", extra={"export": str(record.pk), "rows": result.rows})
    return BuildResult(outcome=Outcome.SUCCEEDED, rows=result.rows)
