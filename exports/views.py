"""Serving export files behind single-use, expiring links (exports/storage.py `download_url`)."""
from django.core import signing
from django.http import FileResponse, Http404
from django.utils import timezone

from exports import storage
from exports.models import DownloadGrant, ExportStatus
from exports.selectors import exports_visible_to

GONE = "This download link is invalid, used or expired."


def export_file(request, token: str):
    try:
        grant_id = storage.read_download_token(token)
    except (signing.BadSignature, KeyError, ValueError, TypeError):  # forged, tampered, expired: alike
        raise Http404(GONE) from None
    grant = DownloadGrant.objects.select_related("user").filter(pk=grant_id, used_at__isnull=True).first()
    # Membership is re-checked at download time: a link outlives nobody's access.
    record = None if grant is None else exports_visible_to(user=grant.user).filter(
        pk=grant.export_id, status=ExportStatus.SUCCEEDED).select_related("account").first()
    # Used once: the guarded UPDATE decides between two requests racing with one link.
    if record is None or DownloadGrant.objects.filter(pk=grant_id, used_at__isnull=True).update(
            used_at=timezone.now()) != 1:
        raise Http404(GONE)
    handle = storage.export_storage().open(record.output_key, "rb")
    response = FileResponse(handle, as_attachment=True, filename=f"{record.account.slug}-{record.source}-{record.pk}.csv",
                            content_type="text/csv; charset=utf-8")
    response["Cache-Control"] = "private, no-store"
    return response
