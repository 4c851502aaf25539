"""Exports' maintenance: repairing what lost messages and dead workers left, purging expired exports."""
import datetime as dt

from django.conf import settings
from django.db.models import DurationField, F, Q, Value
from django.db.models.functions import Coalesce, NullIf
from django.utils import timezone

from budgets.selectors import refs_in_flight
from exports import storage
from exports.models import DownloadGrant, ExportRecord, ExportStatus
from exports.notify import export_notify_once
from exports.requests import BUILD_JOB
from scheduling.models import DeferredTask
from scheduling.runtime import enqueue


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
    # lost, and re-sending goes out on the same slot (budgets knows its slots' lease timing).
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
    # Download links past their TTL are worth nothing, used or not.
    DownloadGrant.objects.filter(
        created_at__lt=now - dt.timedelta(seconds=settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"])).delete()
    purged = 0
    for export_id, account_id in expired.values_list("pk", "account_id"):
        # The object first: a crash in between leaves a record to purge again, never an orphan.
        storage.delete(key=storage.object_key(account_id=account_id, export_id=export_id))
        purged += ExportRecord.objects.filter(pk=export_id).delete()[1].get("exports.ExportRecord", 0)
    return purged
