"""Exports' maintenance: re-sending exports whose message was lost, purging expired ones."""
import datetime as dt

from django.conf import settings
from django.db.models import DurationField, F, Q, Value
from django.db.models.functions import Coalesce, NullIf
from django.utils import timezone

from budgets.models import Reservation, ReservationStatus
from exports import storage
from exports.models import ExportRecord, ExportStatus
from exports.requests import BUILD_JOB
from scheduling.models import DeferredTask
from scheduling.runtime import enqueue


def reconcile_exports() -> int:
    """Re-ring the doorbell for exports whose message was lost: `queued` with nobody running or
    holding them for a while, or `running` with an expired lease (the worker died). Returns how
    many it re-sent. The claim decides what actually runs, so a spare message costs nothing."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=settings.FAIRSHARE["EXPORT_STALE_AFTER_S"])
    held = DeferredTask.objects.filter(job=BUILD_JOB).values_list("ref", flat=True)
    # Running, or sent less than the stale time ago. A dispatched slot's lease ends DISPATCH_LEASE
    # after it was sent (or last re-sent); one sent before the stale time whose export is still
    # queued lost its message, and re-sending goes out on the same slot.
    sent_before_stale = now + dt.timedelta(
        seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"] - settings.FAIRSHARE["EXPORT_STALE_AFTER_S"])
    running = (Reservation.objects.filter(job=BUILD_JOB)
               .exclude(status=ReservationStatus.DISPATCHED, lease_expires_at__lt=sent_before_stale)
               .values_list("ref", flat=True))
    lost = (
        ExportRecord.objects.filter(status=ExportStatus.QUEUED, created_at__lt=stale)
        # Refs are text and ids UUIDs: compared in Python, not as a subquery.
        .exclude(pk__in=[*held, *running])
        | ExportRecord.objects.filter(status=ExportStatus.RUNNING, lease_expires_at__lt=now)
    )
    count = 0
    for export_id, account_id in lost.values_list("pk", "account_id"):
        enqueue(job=BUILD_JOB, account=account_id, ref=str(export_id))
        count += 1
    return count


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
