"""Serving export files behind single-use, expiring links (exports/storage.py `download_url`).

A link that no longer works says why, in the API's JSON error shape: used already or expired (410
Gone, a new link is one request away), not a link at all or no longer the holder's to use (404).
"""
import logging
from http import HTTPStatus

from django.conf import settings
from django.core import signing
from django.http import FileResponse, JsonResponse
from django.utils import timezone

from exports import storage
from exports.errors import error_response
from exports.models import DownloadGrant, ExportStatus
from exports.selectors import exports_visible_to

logger = logging.getLogger("fairshare.exports")
INVALID = "This is not a download link (mistyped, cut short or altered)."
NOT_FOUND = "No such export, or it is no longer yours to download."


def _gone(code: str, why: str, export_id=None) -> JsonResponse:
    where = f"GET /api/exports/{export_id}/download/" if export_id else "GET /api/exports/<id>/download/"
    return error_response(HTTPStatus.GONE, code, f"{why} Ask for a new link: {where}.")


def export_file(request, token: str):
    try:
        grant_id = storage.read_download_token(token)
    except signing.SignatureExpired:  # signed by us, too old
        ttl_s = settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"]
        return _gone("link_expired", f"This download link expired (links last {ttl_s} s).")
    except (signing.BadSignature, KeyError, ValueError, TypeError):  # forged or tampered
        return error_response(HTTPStatus.NOT_FOUND, "invalid_link", INVALID)
    grant = DownloadGrant.objects.select_related("user").filter(pk=grant_id).first()
    if grant is None:  # its export was purged (and the grant with it)
        return error_response(HTTPStatus.NOT_FOUND, "not_found", NOT_FOUND)
    # Membership is re-checked at download time: a link outlives nobody's access.
    record = exports_visible_to(user=grant.user).filter(
        pk=grant.export_id, status=ExportStatus.SUCCEEDED).select_related("account").first()
    if record is None:
        return error_response(HTTPStatus.NOT_FOUND, "not_found", NOT_FOUND)
    if grant.used_at is not None:
        return _gone("link_used", "This download link was used already (a link works once).", record.pk)
    try:
        handle = storage.export_storage().open(record.output_key, "rb")
    except Exception as exc:  # storage unreachable (or the file vanished): the link stays unused
        logger.warning("export download failed to open", extra={"export": str(record.pk),
                                                                 "error_class": type(exc).__name__})
        return error_response(HTTPStatus.SERVICE_UNAVAILABLE, "storage_unavailable",
                              "The file cannot be read right now; the link still works, try again shortly.")
    # Used once: the guarded UPDATE decides between two requests racing with one link.
    if DownloadGrant.objects.filter(pk=grant_id, used_at__isnull=True).update(used_at=timezone.now()) != 1:
        handle.close()
        return _gone("link_used", "This download link was used already (a link works once).", record.pk)
    response = FileResponse(handle, as_attachment=True, filename=f"{record.account.slug}-{record.source}-{record.pk}.csv",
                            content_type="text/csv; charset=utf-8")
    response["Cache-Control"] = "private, no-store"
    return response
