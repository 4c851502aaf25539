"""The JSON API for exports (SPEC §4 Interfaces)."""
from http import HTTPStatus

from django.http import HttpResponseRedirect, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from budgets.auth import ApiCaller, CsrfFailed, api_caller
from budgets.models import Account
from exports import storage
from exports.errors import error_response
from exports.forms import BadBody, ExportRequestForm, read_json_object
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


def _unknown_account(slug: str) -> JsonResponse:
    # One answer for an unknown account, a non-member and a token made for another account:
    # nothing reveals which accounts exist.
    return error_response(HTTPStatus.NOT_FOUND, "unknown_account", f"No account {slug!r}.")


@csrf_exempt  # token clients have no CSRF cookie; api_caller() checks CSRF for session requests
@require_POST
def request_export(request, slug: str):
    try:
        caller = api_caller(request)
    except CsrfFailed as exc:
        return error_response(HTTPStatus.FORBIDDEN, "csrf_failed", f"CSRF check failed: {exc}")
    if caller is None:
        return _unauthenticated()
    try:
        body = read_json_object(content_type=request.content_type, body=request.body,
                                allowed=ExportRequestForm.BODY_FIELDS)
    except BadBody as exc:
        return error_response(exc.status, exc.code, exc.message)
    form = ExportRequestForm({**body, "idempotency_key": request.headers.get("Idempotency-Key", "")})
    if not form.is_valid():
        return error_response(HTTPStatus.BAD_REQUEST, "invalid", form.error_text(), fields=form.errors.get_json_data())
    if caller.account_id is not None and not Account.objects.filter(slug=slug, pk=caller.account_id).exists():
        return _unknown_account(slug)
    data = form.cleaned_data
    try:
        record, created = export_request(
            account_slug=slug, user=caller.user, start=data["start"], end=data["end"], fmt=data["format"],
            source=data["source"], idempotency_key=data["idempotency_key"] or None,
        )
    except ExportRequestError as exc:
        if exc.code in ("not_member", "unknown_account"):
            return _unknown_account(slug)
        return error_response(ERROR_STATUS.get(exc.code, HTTPStatus.BAD_REQUEST), exc.code, exc.message)
    return JsonResponse(export_json(record), status=HTTPStatus.ACCEPTED if created else HTTPStatus.OK)


def _visible_export(request, export_id) -> tuple[ApiCaller | None, ExportRecord | JsonResponse]:
    caller = api_caller(request)
    if caller is None:
        return None, _unauthenticated()
    visible = exports_visible_to(user=caller.user).select_related("account")
    if caller.account_id is not None:  # a token sees its own account's exports only
        visible = visible.filter(account_id=caller.account_id)
    record = visible.filter(pk=export_id).first()
    if record is None:  # someone else's export is indistinguishable from a missing one
        return caller, error_response(HTTPStatus.NOT_FOUND, "not_found", "No such export.")
    return caller, record


@require_GET
def export_detail(request, export_id):
    _, found = _visible_export(request, export_id)
    if isinstance(found, JsonResponse):
        return found
    return JsonResponse(export_json(found))


@require_GET
def export_download(request, export_id):
    """Redirect to a single-use link, valid for EXPORT_DOWNLOAD_TTL_S (docs/architecture.md)."""
    caller, found = _visible_export(request, export_id)
    if isinstance(found, JsonResponse):
        return found
    if found.status != ExportStatus.SUCCEEDED:
        return error_response(HTTPStatus.CONFLICT, "not_ready", f"The export is {found.status}, not succeeded.")
    response = HttpResponseRedirect(storage.download_url(export_id=found.pk, user_id=caller.user.pk))
    response["Cache-Control"] = "private, no-store"  # a link is for this caller, once
    return response



@csrf_exempt  # as request_export: api_caller() checks CSRF for session requests
@require_POST
def retry_export(request, export_id):
    """Run a failed or cancelled export again (same id, fresh attempts): 202 with the export."""
    try:
        caller, found = _visible_export(request, export_id)
    except CsrfFailed as exc:
        return error_response(HTTPStatus.FORBIDDEN, "csrf_failed", f"CSRF check failed: {exc}")
    if isinstance(found, JsonResponse):
        return found
    [result] = export_retry(user=caller.user, export_ids=[found.pk])
    if not result.ok:
        return error_response(ERROR_STATUS.get(result.code, HTTPStatus.FORBIDDEN), result.code, result.message)
    found.refresh_from_db()
    return JsonResponse(export_json(found), status=HTTPStatus.ACCEPTED)
