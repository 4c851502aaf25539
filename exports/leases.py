"""The export's lease/epoch state machine: every status change after the request.

An attempt claims a queued export (or one whose lease expired) and gets a new lease epoch; while
it works it checkpoints (progress + lease renewal), then completes, unclaims (gives the claim
back for a retry) or is cancelled. `_owned` is the fence they share: only the attempt holding
the current epoch of a running, uncancelled export may write.
"""
import datetime as dt
from uuid import UUID

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.db.models.functions import Coalesce, Now
from django.utils import timezone

from exports.models import AttemptOutcome, ExportAttempt, ExportRecord, ExportStatus
from exports.requests import BUILD_JOB
from scheduling.holding import unhold
from scheduling.models import TaskRun
from scheduling.redaction import describe_error


class ExportSuperseded(Exception):
    """This attempt no longer owns the export (lease lost, or the export was finished meanwhile)."""


class ExportCancelled(Exception):
    """Cancellation was requested; the attempt stops between batches and publishes nothing."""


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


def lost_ownership_error(*, export_id: UUID, epoch: int) -> Exception:
    """Why the fence refused this attempt: cancelled (ExportCancelled) or superseded."""
    cancelled = ExportRecord.objects.filter(pk=export_id, lease_epoch=epoch, cancel_requested_at__isnull=False).exists()
    if cancelled:
        return ExportCancelled(f"export {export_id} was cancelled")
    return ExportSuperseded(f"attempt with epoch {epoch} no longer owns export {export_id}")


def export_checkpoint(*, export_id: UUID, epoch: int, rows_written: int) -> None:
    """Report progress and renew the lease; raise if this attempt lost it or was cancelled."""
    if not _owned(export_id, epoch).update(rows_written=rows_written, lease_expires_at=_lease_expiry()):
        raise lost_ownership_error(export_id=export_id, epoch=epoch)


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


def export_unclaim(*, export_id: UUID, epoch: int, refund_attempt: bool = False) -> bool:
    """Give the claim back: queued again, for a retry or a later budget day. A run stopped by the
    budget cap gets its attempt back — waiting for budget never uses up an export's attempts."""
    changes = {"status": ExportStatus.QUEUED, "lease_expires_at": None, "rows_written": 0}
    if refund_attempt:
        changes["attempt_count"] = F("attempt_count") - 1
    # Guarded by the lease epoch: an attempt that lost its lease must not requeue its successor's.
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
            unhold(job=BUILD_JOB, ref=str(record.pk))
            return ExportStatus.CANCELLED
        ExportRecord.objects.filter(pk=record.pk).update(cancel_requested_at=Now())
        return record.status


def export_finish_cancelled(*, export_id: UUID, epoch: int) -> None:
    """The running attempt that saw the cancellation ends the export `cancelled`."""
    ExportRecord.objects.filter(pk=export_id, status=ExportStatus.RUNNING, lease_epoch=epoch).update(
        status=ExportStatus.CANCELLED, completed_at=Now(), lease_expires_at=None)
