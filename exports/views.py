"""Serving export files behind signed, expiring links (local storage; S3 presigns its own)."""
from django.contrib.auth import get_user_model
from django.core import signing
from django.http import FileResponse, Http404

from exports import storage
from exports.models import ExportStatus
from exports.selectors import exports_visible_to


def export_file(request, token: str):
    try:
        export_id, user_id = storage.read_download_token(token)
    except signing.BadSignature:  # forged, tampered or expired: all look alike
        raise Http404("This download link is invalid or has expired.") from None
    user = get_user_model().objects.filter(pk=user_id).first()
    # Membership is re-checked at download time: a link outlives nobody's access.
    record = exports_visible_to(user=user).filter(pk=export_id, status=ExportStatus.SUCCEEDED).first()
    if record is None:
        raise Http404("This download link is invalid or has expired.")
    handle = storage.export_storage().open(record.output_key, "rb")
    response = FileResponse(handle, as_attachment=True, filename=f"{record.account.slug}-{record.source}-{record.pk}.csv",
                            content_type="text/csv; charset=utf-8")
    response["Cache-Control"] = "private, no-store"
    return response
