"""Writes of the exports app: requesting an export and the attempt that builds it."""
import datetime as dt
import logging
import time
from dataclasses import dataclass
from uuid import UUID
from zoneinfo import ZoneInfo

from django.conf import settings
from django.core.mail import EmailMessage
from django.db import IntegrityError, transaction
from django.db.models import DurationField, F, Q, Value
from django.db.models.functions import Coalesce, Now, NullIf
from django.utils import timezone

from budgets.limits import BudgetExhausted, RunBudget, UnlimitedBudget
from budgets.metering import Meter
from budgets.models import Account
from budgets.selectors import can_export, membership_of, refs_in_flight
from exports import storage
from exports.models import (
    AttemptOutcome, ExportAttempt, ExportFormat, ExportRecord, ExportSchedule, ExportStatus, SchedulePeriod,
)
from exports.sources import SOURCES, day_bounds, get_source
from exports.streaming import stream_csv
from scheduling.faults import fault_point
from scheduling.models import DeferredTask, Outcome, TaskRun
from scheduling.redaction import describe_error
from scheduling.runtime import close_old_connections, enqueue, enqueue_on_commit

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


class ExportCancelled(Exception):
    """Cancellation was requested; the attempt stops between batches and publishes nothing."""


class ExportNotAuthorised(Exception):
    """The export may no longer be built (account deactivated, requester lost the right)."""


class ExportTimeLimit(Exception):
    """The attempt ran past its overall deadline (EXPORT_ATTEMPT_DEADLINE_S)."""


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
        if record.cancel_requested_at is not None:
            ExportRecord.objects.filter(pk=record.pk).update(
                status=ExportStatus.CANCELLED, completed_at=Now(), lease_expires_at=None)
            return None
        if record.attempt_count >= record.attempt_limit:
            ExportRecord.objects.filter(pk=record.pk).update(
                status=ExportStatus.FAILED, error_class="AttemptsExhausted",
                error_message=f"gave up after {record.attempt_count} attempts", completed_at=Now(),
                lease_expires_at=None,
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


def _owned(export_id: UUID, epoch: int):
    # The fence: only the attempt holding the current epoch, on a running, uncancelled export.
    return ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch, cancel_requested_at__isnull=True,
    )


def _lost_ownership(export_id: UUID, epoch: int) -> Exception:
    cancelled = ExportRecord.objects.filter(pk=export_id, lease_epoch=epoch, cancel_requested_at__isnull=False).exists()
    if cancelled:
        return ExportCancelled(f"export {export_id} was cancelled")
    return ExportSuperseded(f"attempt with epoch {epoch} no longer owns export {export_id}")


def export_heartbeat(*, export_id: UUID, epoch: int, rows_written: int) -> None:
    """Report progress and renew the lease; raise if this attempt lost it or was cancelled."""
    if not _owned(export_id, epoch).update(rows_written=rows_written, lease_expires_at=_lease_expiry()):
        raise _lost_ownership(export_id, epoch)


def export_complete(
    *, export_id: UUID, epoch: int, key: str, rows: int, byte_size: int, checksum: str, retention_days: int,
) -> bool:
    # Guarded by the lease epoch: a stale attempt that lost its lease must not win.
    retention = dt.timedelta(days=retention_days)
    return _owned(export_id, epoch).update(
        status=ExportStatus.SUCCEEDED, output_key=key, row_count=rows, rows_written=rows,
        byte_size=byte_size, checksum_sha256=checksum, completed_at=Now(),
        expires_at=timezone.now() + retention, lease_expires_at=None, error_class="", error_message="",
    ) == 1


def export_release(*, export_id: UUID, epoch: int, refund_attempt: bool = False) -> bool:
    """Give the claim back: queued again, for a retry or a later budget day. A run stopped by the
    budget cap gets its attempt back — waiting for budget never uses up an export's attempts."""
    changes = {"status": ExportStatus.QUEUED, "lease_expires_at": None, "rows_written": 0}
    if refund_attempt:
        changes["attempt_count"] = F("attempt_count") - 1
    return ExportRecord.objects.filter(
        pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch,
    ).update(**changes) == 1


def export_give_up(*, export_id: UUID, error: BaseException) -> bool:
    """Fail the export for good (terminal error or out of attempts), keeping a redacted reason."""
    error_class, message = describe_error(error)
    return ExportRecord.objects.filter(
        pk=export_id, status__in=[ExportStatus.QUEUED, ExportStatus.RUNNING],
    ).update(
        status=ExportStatus.FAILED, error_class=error_class, error_message=message,
        completed_at=Now(), lease_expires_at=None,
    ) == 1


def export_cancel(*, export_id: UUID) -> str:
    """Cancel an export: at once if it is waiting, between batches if it is running.

    Returns the export's status after the request. Nothing is published for a cancelled export.
    """
    with transaction.atomic():
        # Row lock: a claim racing this cancellation sees either the request or the final state.
        record = ExportRecord.objects.select_for_update().filter(pk=export_id).first()
        if record is None:
            raise ExportRecord.DoesNotExist(export_id)
        if record.is_finished:
            return record.status
        if record.status == ExportStatus.QUEUED:
            ExportRecord.objects.filter(pk=record.pk).update(
                status=ExportStatus.CANCELLED, cancel_requested_at=Now(), completed_at=Now())
            DeferredTask.objects.filter(job=BUILD_JOB, ref=str(record.pk)).delete()
            return ExportStatus.CANCELLED
        ExportRecord.objects.filter(pk=record.pk).update(cancel_requested_at=Now())
        return record.status


def _finish_cancelled(*, export_id: UUID, epoch: int) -> None:
    ExportRecord.objects.filter(pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch).update(
        status=ExportStatus.CANCELLED, completed_at=Now(), lease_expires_at=None)


def export_notify_once(*, export_id: UUID) -> bool:
    """Tell the requester their export is ready, exactly once (a conditional `notified_at`)."""
    with transaction.atomic():
        if not ExportRecord.objects.filter(
            pk=export_id, status=ExportStatus.SUCCEEDED, notified_at__isnull=True,
        ).update(notified_at=Now()):
            return False
        record = ExportRecord.objects.select_related("account", "requested_by").get(pk=export_id)
        user = record.requested_by
        if user is not None and user.email:
            # Sent inside the transaction that marks it (docs/architecture.md, "Notification"):
            # if sending fails, notified_at rolls back and the next run or reconciler tick sends
            # it; only a crash between the mail server's acceptance and this commit can send it
            # twice, and then both copies carry the same Message-ID. No customer data in the
            # message, only where to fetch the file.
            EmailMessage(
                subject=f"Your {record.source} export of {record.account.name} is ready",
                body=(f"Export {record.pk} ({record.start_date} to {record.end_date}) finished with "
                      f"{record.row_count} rows.\nDownload it (sign-in required): /api/exports/{record.pk}/download/\n"),
                to=[user.email], headers={"Message-ID": f"<export-ready-{record.pk}@fairshare>"},
            ).send()
    return True


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
    """One attempt: claim, reconcile or build, publish under the export's key, complete, notify.

    Between batches it renews its lease, honours cancellation, the attempt's deadline and the
    run's CPU budget. Failures release the claim and propagate to the retry middleware, which
    decides between a retry and giving up (`export_give_up`).
    """
    budget = budget or UnlimitedBudget()
    fault_point("before_claim")
    attempt = export_claim(export_id=export_id, account_id=account_id, owner=owner, task_run=task_run)
    if attempt is None:
        # Nothing to build — but a run that died after completing may still owe the notification.
        export_notify_once(export_id=export_id)
        return BuildResult(outcome=Outcome.SKIPPED)
    fault_point("after_claim")
    record = attempt.export
    epoch = attempt.epoch
    key = storage.object_key(account_id=record.account_id, export_id=record.pk)
    deadline = time.monotonic() + settings.FAIRSHARE["EXPORT_ATTEMPT_DEADLINE_S"]
    rows = 0

    def checkpoint(rows_so_far: int) -> None:
        """Between batches and before publishing: still ours, not cancelled, in time, in budget."""
        nonlocal rows
        rows = rows_so_far
        export_heartbeat(export_id=record.pk, epoch=epoch, rows_written=rows_so_far)
        budget.check()
        if time.monotonic() > deadline:
            raise ExportTimeLimit(f"the attempt passed its {settings.FAIRSHARE['EXPORT_ATTEMPT_DEADLINE_S']} s deadline")

    def on_batch(rows_so_far: int) -> None:
        checkpoint(rows_so_far)
        fault_point("mid_stream")

    try:
        _authorise(record)
        outcome = AttemptOutcome.RECONCILED
        result = storage.find_published(key=key, export_id=record.pk, meter=meter)
        if result is None:
            outcome = AttemptOutcome.SUCCEEDED
            result = _build_and_publish(record, key=key, meter=meter, on_batch=on_batch, checkpoint=checkpoint)
            fault_point("after_publish")
        rows = result.rows
        if not export_complete(
            export_id=record.pk, epoch=epoch, key=key, rows=result.rows,
            byte_size=result.byte_size, checksum=result.sha256,
            retention_days=record.account.export_retention_days or settings.FAIRSHARE["EXPORT_RETENTION_DAYS"],
        ):
            raise _lost_ownership(record.pk, epoch)
    except ExportSuperseded:
        _attempt_finish(attempt, outcome=AttemptOutcome.SUPERSEDED, rows=rows)
        return BuildResult(outcome=Outcome.SKIPPED, rows=rows)
    except ExportCancelled:
        storage.delete(key=key)  # whatever this attempt may have published
        _finish_cancelled(export_id=record.pk, epoch=epoch)
        _attempt_finish(attempt, outcome=AttemptOutcome.CANCELLED, rows=rows)
        return BuildResult(outcome=Outcome.CANCELLED, rows=rows)
    except BudgetExhausted:
        export_release(export_id=record.pk, epoch=epoch, refund_attempt=True)
        _attempt_finish(attempt, outcome=AttemptOutcome.BUDGET_EXHAUSTED, rows=rows)
        raise
    except BaseException as exc:
        _record_failure(attempt, rows=rows, error=exc)
        raise
    _attempt_finish(attempt, outcome=outcome, rows=result.rows)
    fault_point("before_notify")
    export_notify_once(export_id=record.pk)
    fault_point("after_complete")
    logger.info("export completed", extra={"export": str(record.pk), "rows": result.rows, "how": outcome})
    return BuildResult(outcome=Outcome.SUCCEEDED, rows=result.rows)


def _record_failure(attempt: ExportAttempt, *, rows: int, error: BaseException) -> None:
    """Record a failed attempt and give its claim back, so that a retry can claim it at once."""
    for reconnect in (False, True):
        try:
            if reconnect:
                # The failure may have been this worker's database connection dropping: Django
                # keeps a broken connection until it is closed; the next query reconnects.
                close_old_connections()
            _attempt_finish(attempt, outcome=AttemptOutcome.FAILED, rows=rows, error=error)
            export_release(export_id=attempt.export_id, epoch=attempt.epoch)
            return
        except Exception:
            pass
    # The database is still away. The record keeps its lease, which expires, and the reconciler
    # sends it again; the original error is what we report.
    logger.warning("could not record the failure of export %s", attempt.export_id)


def _build_and_publish(record: ExportRecord, *, key: str, meter: Meter, on_batch, checkpoint) -> storage.Manifest:
    since, until = day_bounds(record.start_date, record.end_date)
    with storage.staging_file() as tmp:
        result = stream_csv(
            source=get_source(record.source), account_id=record.account_id, since=since, until=until,
            out=tmp, meter=meter, on_batch=on_batch,
        )
        tmp.flush()
        manifest = storage.Manifest(export_id=str(record.pk), sha256=result.sha256, rows=result.rows,
                                    byte_size=result.byte_size)
        # Fence before the side effect: don't publish for an attempt that lost its lease.
        checkpoint(result.rows)
        storage.publish(key=key, fileobj=tmp, manifest=manifest, meter=meter)
    return manifest


def reconcile_exports() -> int:
    """Repair what a lost doorbell or a dead worker left behind; returns how many exports it
    touched: re-sent (see `_resend_lost`) plus notices sent (see `_notify_unnotified`)."""
    return _resend_lost() + _notify_unnotified()


def _resend_lost() -> int:
    """Re-ring the doorbell for exports whose message was lost: `queued` for a while with nothing
    in flight or held for them, or `running` with an expired lease (the worker died). The claim
    decides what actually runs, so a spare message costs nothing."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=settings.FAIRSHARE["EXPORT_STALE_AFTER_S"])
    held = DeferredTask.objects.filter(job=BUILD_JOB).values_list("ref", flat=True)
    # A slot whose run was reclaimed (its worker died after admission, before the claim) carries
    # nothing any more; a message sent before the stale time whose export is still queued was
    # lost, and re-sending goes out on the same slot.
    in_flight = refs_in_flight(job=BUILD_JOB, sent_since=stale)
    lost = (
        ExportRecord.objects.filter(status=ExportStatus.QUEUED, created_at__lt=stale)
        # Refs are text and ids UUIDs: compared in Python, not as a subquery.
        .exclude(pk__in=[*held, *in_flight])
        | ExportRecord.objects.filter(status=ExportStatus.RUNNING, lease_expires_at__lt=now)
    )
    count = 0
    for export_id, account_id in lost.values_list("pk", "account_id"):
        enqueue(job=BUILD_JOB, account=account_id, ref=str(export_id))
        count += 1
    return count


def _notify_unnotified() -> int:
    """Send the "export ready" notice a worker owed when it died between completing the export and
    notifying (no broker redelivers that run: Redis never does, the ORM broker only after `retry`).
    `export_notify_once` decides under the row lock, so a racing worker and this never both send."""
    pending = ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED, notified_at__isnull=True)
    return sum(export_notify_once(export_id=export_id) for export_id in pending.values_list("pk", flat=True))


# --- Maintenance and recurring exports -------------------------------------------------------

def purge_expired_exports() -> int:
    """Delete exports past their retention, and their stored objects. Returns exports purged.

    Succeeded exports expire at `expires_at` (set at completion from the account's retention or
    the default); failed and cancelled ones the same number of days after they finished.
    """
    now = timezone.now()
    # Account.export_retention_days, or the default when empty (0 too, as at completion).
    retention_days = Coalesce(
        NullIf(F("account__export_retention_days"), 0), settings.FAIRSHARE["EXPORT_RETENTION_DAYS"])
    one_day = Value(dt.timedelta(days=1), output_field=DurationField())
    expired = ExportRecord.objects.filter(
        Q(status=ExportStatus.SUCCEEDED, expires_at__lt=now)
        | Q(status__in=[ExportStatus.FAILED, ExportStatus.CANCELLED], completed_at__lt=now - retention_days * one_day)
    )
    purged = 0
    for export_id, account_id in expired.values_list("pk", "account_id"):
        # The object first: a crash in between leaves a record to purge again, never an orphan.
        storage.delete(key=storage.object_key(account_id=account_id, export_id=export_id))
        purged += ExportRecord.objects.filter(pk=export_id).delete()[1].get("exports.ExportRecord", 0)
    return purged


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
    """
    now = now or timezone.now()
    created = 0
    for schedule in ExportSchedule.objects.filter(is_active=True, account__is_active=True).select_related(
        "account", "requested_by"
    ):
        start, end = schedule_period(schedule, now)
        if day_bounds(start, end)[1] > now:
            # An export's dates are UTC days (sources.day_bounds): east of UTC, the local run time
            # can come before the period's last UTC day is over, and an export requested now would
            # miss the rest of it for good (its key makes it the period's only export). A later
            # tick, once the period is over, requests it.
            continue
        try:
            _, was_created = export_request(
                account_slug=schedule.account.slug, user=schedule.requested_by, start=start, end=end,
                fmt=schedule.format, source=schedule.source,
                idempotency_key=f"schedule-{schedule.pk}-{start.isoformat()}",
            )
        except ExportRequestError as exc:
            logger.warning("recurring export refused", extra={"schedule": schedule.pk, "code": exc.code})
            continue
        created += was_created
    return created
