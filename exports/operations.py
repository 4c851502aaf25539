"""Operator actions on exports: retry, cancel, run a recurring export now.

Each checks the role (operators act on work), reports per item and writes the admin log; the
admin, `manage.py retry_export` / `cancel_export` and the API call these.
"""
from uuid import UUID

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from exports.leases import export_cancel
from exports.models import ExportRecord, ExportSchedule, ExportStatus
from exports.recurring import schedule_period
from exports.requests import BUILD_JOB, ExportRequestError, export_request
from scheduling.operator import ItemResult, log_action, refusal
from scheduling.runtime import enqueue_on_commit

RETRYABLE = (ExportStatus.FAILED, ExportStatus.CANCELLED)
# Attempts a retry grants: a fresh budget as large as a new export's.
RETRY_ATTEMPTS = ExportRecord._meta.get_field("attempt_limit").default


def export_retry(*, user, export_ids: list[UUID]) -> list[ItemResult]:
    """Run a failed or cancelled export again: same id, a fresh attempt budget, its attempts and
    task runs kept. The build reuses the export's deterministic key, so a retry never publishes a
    second object, and the one notification is sent when it succeeds."""
    results = []
    for export_id in export_ids:
        with transaction.atomic():
            # Row lock: two operators retrying at once send one build, and a retry racing a
            # cancel sees the other's final state.
            record = ExportRecord.objects.select_for_update().filter(pk=export_id).first()
            why = "not found" if record is None else refusal(user=user, account_id=record.account_id, needs="operator")
            code = "not_found" if why == "not found" else "not_allowed"
            if not why and record.status not in RETRYABLE:
                why, code = f"it is {record.status}; only failed or cancelled exports can be retried", "not_retryable"
            if why:
                results.append(ItemResult(f"export {export_id}", False, why, code))
                continue
            ExportRecord.objects.filter(pk=record.pk).update(
                status=ExportStatus.QUEUED, attempt_limit=F("attempt_count") + RETRY_ATTEMPTS,
                error_class="", error_message="", cancel_requested_at=None, completed_at=None,
                lease_expires_at=None, lease_owner="", rows_written=0,
            )
            enqueue_on_commit(job=BUILD_JOB, account=record.account_id, ref=str(record.pk))
            log_action(user=user, obj=record, message=f"Retried (was {record.status}: {record.error_class or 'cancelled'})")
            results.append(ItemResult(f"export {export_id}", True, "queued again"))
    return results


def export_cancel_by(*, user, export_ids: list[UUID]) -> list[ItemResult]:
    """An operator's cancel: at once if waiting, between batches if running."""
    results = []
    for export_id in export_ids:
        record = ExportRecord.objects.filter(pk=export_id).only("account_id", "status").first()
        why = "not found" if record is None else refusal(user=user, account_id=record.account_id, needs="operator")
        if why:
            results.append(ItemResult(f"export {export_id}", False, why))
            continue
        with transaction.atomic():
            status = export_cancel(export_id=record.pk)  # locks the row itself
            if status in (ExportStatus.SUCCEEDED, ExportStatus.FAILED) or (
                    status == ExportStatus.CANCELLED and record.status == ExportStatus.CANCELLED):
                results.append(ItemResult(f"export {export_id}", False, f"it is already {status}"))
                continue
            log_action(user=user, obj=record, message="Cancel requested")
        note = "cancelled" if status == ExportStatus.CANCELLED else "stops at its next batch"
        results.append(ItemResult(f"export {export_id}", True, note))
    return results


def export_schedule_run_now(*, user, schedule_ids: list[int]) -> list[ItemResult]:
    """Request a recurring export's latest period now (its key makes it that period's only
    export: running it twice, or before its time comes, returns the same export)."""
    results = []
    now = timezone.now()
    for schedule in ExportSchedule.objects.filter(pk__in=schedule_ids).select_related("account", "requested_by"):
        label = f"recurring export {schedule}"
        why = refusal(user=user, account_id=schedule.account_id, needs="operator")
        if why:
            results.append(ItemResult(label, False, why))
            continue
        start, end = schedule_period(schedule, now)
        try:
            record, created = export_request(
                account_slug=schedule.account.slug, user=schedule.requested_by, start=start, end=end,
                fmt=schedule.format, source=schedule.source, idempotency_key=f"schedule-{schedule.pk}-{start.isoformat()}",
            )
        except ExportRequestError as exc:
            results.append(ItemResult(label, False, exc.message))
            continue
        log_action(user=user, obj=schedule, message=f"Ran now: export {record.pk}")
        results.append(ItemResult(label, True, f"export {record.pk} {'requested' if created else 'exists already'}"
                                  f" ({start} to {end}, {record.status})"))
    return results
