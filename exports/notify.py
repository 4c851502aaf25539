"""Telling the requester their export is ready."""
from uuid import UUID

from django.core.mail import EmailMessage
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
