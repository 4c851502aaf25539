"""The JSON API for exports (SPEC §4 Interfaces)."""
import json
from http import HTTPStatus

from django.http import HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from budgets.auth import CsrfFailed, api_user
from exports import storage
from exports.forms import ExportRequestForm
from exports.models import ExportRecord, ExportStatus
from exports.operations import export_retry
from exports.requests import ExportRequestError, export_request
from exports.selectors import exports_visible_to

ERROR_STATUS = {
    "unknown_account": HTTPStatus.NOT_FOUND,  # also a non-member's answer (see request_export)
    "not_allowed": HTTPStatus.FORBIDDEN,
    "account_inactive": HTTPStatus.FORBIDDEN,
    "idempotency_key_reused": HTTPStatus.CONFLICT,
    "too_many_rows": HTTPStatus.UNPROCESSABLE_ENTITY,
    "not_retryable": HTTPStatus.CONFLICT,
}


def error_response(status: int, code: str, message: str, **extra) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, **extra}}, status=status)


def export_json(record: ExportRecord) -> dict:
    return {
        "id": str(record.pk),
        "account": record.account.slug,
        "source": record.source,
        "format": record.format,
        "start": record.start_date.isoformat(),
        "end": record.end_date.isoformat(),
        "status": record.status,
        "progress_percent": record.progress_percent,
        "rows_written": record.rows_written,
        "row_count": record.row_count,
        "byte_size": record.byte_size,
        "checksum_sha256": record.checksum_sha256 or None,
        "attempts": record.attempt_count,
        "error": {"class": record.error_class, "message": record.error_message} if record.error_class else None,
        "created_at": record.created_at.isoformat(),
        "completed_at": record.completed_at.isoformat() if record.completed_at else None,
        "expires_at": record.expires_at.isoformat() if record.expires_at else None,
        "links": {
            "self": f"/api/exports/{record.pk}/",
            "download": f"/api/exports/{record.pk}/download/" if record.status == ExportStatus.SUCCEEDED else None,
        },
    }


def _unauthenticated() -> JsonResponse:
    response = error_response(HTTPStatus.UNAUTHORIZED, "unauthenticated", "Send a bearer token or log in.")
    response["WWW-Authenticate"] = 'Bearer realm="fairshare"'
    return response


@csrf_exempt  # token clients have no CSRF cookie; api_user() checks CSRF for session requests
@require_POST
def request_export(request, slug: str):
    try:
        user = api_user(request)
    except CsrfFailed as exc:
        return error_response(HTTPStatus.FORBIDDEN, "csrf_failed", f"CSRF check failed: {exc}")
    if user is None:
        return _unauthenticated()
    try:
        body = json.loads(request.body or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(HTTPStatus.BAD_REQUEST, "malformed_json", "The body must be a JSON object.")
    if not isinstance(body, dict):
        return error_response(HTTPStatus.BAD_REQUEST, "malformed_json", "The body must be a JSON object.")
    form = ExportRequestForm({**body, "idempotency_key": request.headers.get("Idempotency-Key", "")})
    if not form.is_valid():
        return error_response(HTTPStatus.BAD_REQUEST, "invalid", form.error_text(), fields=form.errors.get_json_data())
    data = form.cleaned_data
    try:
        record, created = export_request(
            account_slug=slug, user=user, start=data["start"], end=data["end"], fmt=data["format"],
            source=data["source"], idempotency_key=data["idempotency_key"] or None,
        )
    except ExportRequestError as exc:
        if exc.code == "not_member":
            # Answer exactly as for an unknown account: don't reveal which accounts exist.
            exc = ExportRequestError("unknown_account", f"No account {slug!r}.")
        return error_response(ERROR_STATUS.get(exc.code, HTTPStatus.BAD_REQUEST), exc.code, exc.message)
    return JsonResponse(export_json(record), status=HTTPStatus.ACCEPTED if created else HTTPStatus.OK)


def _visible_export(request, export_id) -> tuple[object, ExportRecord | JsonResponse]:
    user = api_user(request)
    if user is None:
        return None, _unauthenticated()
    record = exports_visible_to(user=user).select_related("account").filter(pk=export_id).first()
    if record is None:  # someone else's export is indistinguishable from a missing one
        return user, error_response(HTTPStatus.NOT_FOUND, "not_found", "No such export.")
    return user, record


@require_GET
def export_detail(request, export_id):
    _, found = _visible_export(request, export_id)
    if isinstance(found, JsonResponse):
        return found
    return JsonResponse(export_json(found))


@require_GET
def export_download(request, export_id):
    """Redirect to a short-lived URL for the file: signed for local storage, presigned on S3."""
    user, found = _visible_export(request, export_id)
    if isinstance(found, JsonResponse):
        return found
    if found.status != ExportStatus.SUCCEEDED:
        return error_response(HTTPStatus.CONFLICT, "not_ready", f"The export is {found.status}, not succeeded.")
    return HttpResponseRedirect(storage.download_url(export_id=found.pk, key=found.output_key, user_id=user.pk))




@csrf_exempt  # as request_export: api_user() checks CSRF for session requests
@require_POST
def retry_export(request, export_id):
    """Run a failed or cancelled export again (same id, fresh attempts): 202 with the export."""
    try:
        user, found = _visible_export(request, export_id)
    except CsrfFailed as exc:
        return error_response(HTTPStatus.FORBIDDEN, "csrf_failed", f"CSRF check failed: {exc}")
    if isinstance(found, JsonResponse):
        return found
    [result] = export_retry(user=user, export_ids=[found.pk])
    if not result.ok:
        return error_response(ERROR_STATUS.get(result.code, HTTPStatus.FORBIDDEN), result.code, result.message)
    found.refresh_from_db()
    return JsonResponse(export_json(found), status=HTTPStatus.ACCEPTED)
