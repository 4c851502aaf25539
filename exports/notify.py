"""Telling the requester their export is ready."""
from uuid import UUID

from django.core.mail import send_mail
from django.db import transaction
from django.db.models.functions import Now

from exports.models import ExportRecord, ExportStatus


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
            # Sent inside the transaction: if sending fails, notified_at rolls back and a retry
            # sends it. No customer data in the message, only where to fetch the file.
            send_mail(
                subject=f"Your {record.source} export of {record.account.name} is ready",
                message=(f"Export {record.pk} ({record.start_date} to {record.end_date}) finished with "
                         f"{record.row_count} rows.\nDownload it (sign-in required): /api/exports/{record.pk}/download/\n"),
                from_email=None, recipient_list=[user.email],
            )
    return True
