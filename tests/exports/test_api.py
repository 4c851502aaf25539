"""The JSON API for exports, through Django's test client (SPEC §4 Interfaces)."""
import datetime as dt
import json

import pytest
from django.conf import settings
from django.http import HttpRequest
from django.middleware.csrf import get_token
from django.test import Client
from django_q.models import OrmQ

from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from tests.exports.support import bearer

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

URL = "/api/accounts/acme/exports/"
BODY = {"start": "2026-03-01", "end": "2026-03-31", "format": "csv"}


def _post(client, url=URL, body=BODY, **headers):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(url, data=data, content_type="application/json", **headers)


def _error(response) -> dict:
    assert response["Content-Type"] == "application/json"
    return response.json()["error"]


def _assert_nothing_created():
    assert ExportRecord.objects.count() == 0
    assert OrmQ.objects.count() == 0


# --- POST /api/accounts/<slug>/exports/ -------------------------------------------------------

def test_bearer_token_requests_an_export(account, owner, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        response = _post(Client(), **bearer(owner))
    assert response.status_code == 202
    data = response.json()
    record = ExportRecord.objects.get()
    assert data["id"] == str(record.pk)
    assert (data["status"], data["account"], data["start"], data["end"]) == ("queued", "acme", "2026-03-01", "2026-03-31")
    assert (data["format"], data["source"]) == ("csv", "activity")
    assert data["links"] == {"self": f"/api/exports/{record.pk}/", "download": None}
    assert record.requested_by == owner
    assert OrmQ.objects.count() == 1


def test_repeated_idempotency_key_returns_the_same_export(account, owner, django_capture_on_commit_callbacks):
    client, auth = Client(), bearer(owner)
    with django_capture_on_commit_callbacks(execute=True):
        first = _post(client, HTTP_IDEMPOTENCY_KEY="march-report", **auth)
        again = _post(client, HTTP_IDEMPOTENCY_KEY="march-report", **auth)
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == first.json()["id"]
    assert ExportRecord.objects.get().idempotency_key == "march-report"
    assert OrmQ.objects.count() == 1


def test_idempotency_key_reused_for_another_scope_is_a_conflict(account, owner):
    client, auth = Client(), bearer(owner)
    assert _post(client, HTTP_IDEMPOTENCY_KEY="k", **auth).status_code == 202
    response = _post(client, body={**BODY, "end": "2026-03-30"}, HTTP_IDEMPOTENCY_KEY="k", **auth)
    assert response.status_code == 409
    assert _error(response)["code"] == "idempotency_key_reused"
    assert ExportRecord.objects.count() == 1


def test_no_authentication_is_401(account, owner):
    response = _post(Client())
    assert response.status_code == 401
    assert _error(response)["code"] == "unauthenticated"
    assert response["WWW-Authenticate"].startswith("Bearer")
    _assert_nothing_created()


@pytest.mark.parametrize("header", ["Bearer fs_not-a-real-token", "Bearer ", "Basic YWRtaW46YWRtaW4="])
def test_bad_token_is_401(account, owner, header):
    response = _post(Client(), HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    assert _error(response)["code"] == "unauthenticated"
    _assert_nothing_created()


def test_token_of_an_inactive_user_is_401(account, owner):
    auth = bearer(owner)
    owner.is_active = False
    owner.save()
    assert _post(Client(), **auth).status_code == 401
    _assert_nothing_created()


@pytest.mark.parametrize("body", ['{"start": "2026-03-01",', "not json", '["2026-03-01", "2026-03-31"]', "42",
                                  b"\xff\xfe"])
def test_malformed_json_is_400(account, owner, body):
    response = _post(Client(), body=body, **bearer(owner))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "malformed_json"
    assert error["message"] == "The body must be a JSON object."
    _assert_nothing_created()


def test_malformed_date_is_400_with_field_errors(account, owner):
    response = _post(Client(), body={**BODY, "start": "2026-13-01"}, **bearer(owner))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "invalid"
    assert error["message"] == "start: Use a date as YYYY-MM-DD."
    assert error["fields"] == {"start": [{"message": "Use a date as YYYY-MM-DD.", "code": "invalid"}]}
    _assert_nothing_created()


def test_missing_dates_are_400_with_field_errors(account, owner):
    response = _post(Client(), body={"format": "csv"}, **bearer(owner))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "invalid"
    assert set(error["fields"]) == {"start", "end"}
    assert error["fields"]["end"][0]["code"] == "required"
    _assert_nothing_created()


@pytest.mark.parametrize("start", [20260301, ["2026-03-01"], {"y": 2026}, True])
def test_dates_of_the_wrong_json_type_are_400_not_a_crash(account, owner, start):
    response = _post(Client(), body={**BODY, "start": start}, **bearer(owner))
    assert response.status_code == 400
    error = _error(response)
    assert error["code"] == "invalid"
    assert error["fields"]["start"][0]["code"] == "invalid"
    _assert_nothing_created()


@pytest.mark.parametrize(("body", "code"), [
    ({**BODY, "end": "2026-02-28"}, "invalid_range"),
    ({**BODY, "format": "xlsx"}, "unsupported_format"),
    ({**BODY, "source": "payroll"}, "unknown_source"),
    ({**BODY, "start": "2024-01-01"}, "range_too_large"),
])
def test_scope_errors_are_400_with_the_services_code(account, owner, body, code):
    response = _post(Client(), body=body, **bearer(owner))
    assert response.status_code == 400
    assert _error(response)["code"] == code
    _assert_nothing_created()


def test_non_member_and_unknown_account_are_indistinguishable_404s(account, other_account, outsider):
    client, auth = Client(), bearer(outsider)
    not_member = _post(client, url="/api/accounts/acme/exports/", **auth)
    unknown = _post(client, url="/api/accounts/initech/exports/", **auth)
    assert (not_member.status_code, unknown.status_code) == (404, 404)
    not_member_error, unknown_error = _error(not_member), _error(unknown)
    assert not_member_error["code"] == unknown_error["code"]
    # Only the slug the caller sent may differ: nothing reveals that "acme" exists.
    assert not_member_error["message"].replace("acme", "SLUG") == unknown_error["message"].replace("initech", "SLUG")
    assert set(not_member.json()) == set(unknown.json()) == {"error"}
    _assert_nothing_created()


def test_viewer_is_403(account, viewer):
    response = _post(Client(), **bearer(viewer))
    assert response.status_code == 403
    assert _error(response)["code"] == "not_allowed"
    _assert_nothing_created()


def test_inactive_account_is_403_for_its_members(account, owner):
    account.is_active = False
    account.save()
    response = _post(Client(), **bearer(owner))
    assert response.status_code == 403
    assert _error(response)["code"] == "account_inactive"
    _assert_nothing_created()


def test_session_without_csrf_token_is_rejected(account, owner):
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    response = _post(client)
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "csrf_failed"
    _assert_nothing_created()


def test_session_with_csrf_token_is_accepted(account, owner):
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    token = get_token(HttpRequest())
    client.cookies[settings.CSRF_COOKIE_NAME] = token
    response = _post(client, HTTP_X_CSRFTOKEN=token)
    assert response.status_code == 202
    assert response.json()["id"] == str(ExportRecord.objects.get().pk)


def test_session_with_a_wrong_csrf_token_is_rejected(account, owner):
    client = Client(enforce_csrf_checks=True)
    client.force_login(owner)
    client.cookies[settings.CSRF_COOKIE_NAME] = get_token(HttpRequest())
    response = _post(client, HTTP_X_CSRFTOKEN=get_token(HttpRequest()))
    assert response.status_code == 403 and response.json()["error"]["code"] == "csrf_failed"
    _assert_nothing_created()


def test_get_is_not_allowed_on_the_request_endpoint(account, owner):
    assert Client().get(URL, **bearer(owner)).status_code == 405


# --- GET /api/exports/<id>/ and /download/ ----------------------------------------------------

@pytest.fixture
def queued_export(account, owner):
    record, _ = export_request(account_slug="acme", user=owner, start=dt.date(2026, 3, 1), end=dt.date(2026, 3, 31))
    return record


def test_member_sees_the_export_status(queued_export, viewer):
    response = Client().get(f"/api/exports/{queued_export.pk}/", **bearer(viewer))
    assert response.status_code == 200
    data = response.json()
    assert data["id"] == str(queued_export.pk)
    assert (data["status"], data["account"], data["attempts"], data["error"]) == ("queued", "acme", 0, None)


def test_member_sees_the_export_status_through_the_session(queued_export, owner):
    client = Client()
    client.force_login(owner)
    response = client.get(f"/api/exports/{queued_export.pk}/")
    assert response.status_code == 200
    assert response.json()["id"] == str(queued_export.pk)


def test_another_accounts_member_gets_404_for_the_export(queued_export, outsider):
    client, auth = Client(), bearer(outsider)
    for url in (f"/api/exports/{queued_export.pk}/", f"/api/exports/{queued_export.pk}/download/"):
        response = client.get(url, **auth)
        assert response.status_code == 404
        assert _error(response) == {"code": "not_found", "message": "No such export."}


def test_someone_elses_export_looks_like_a_missing_one(queued_export, outsider):
    client, auth = Client(), bearer(outsider)
    theirs = client.get(f"/api/exports/{queued_export.pk}/", **auth)
    missing = client.get("/api/exports/00000000-0000-0000-0000-000000000000/", **auth)
    assert theirs.status_code == missing.status_code == 404
    assert theirs.json() == missing.json()


def test_export_status_needs_authentication(queued_export):
    response = Client().get(f"/api/exports/{queued_export.pk}/")
    assert response.status_code == 401
    assert _error(response)["code"] == "unauthenticated"


def test_download_of_a_queued_export_is_409_not_ready(queued_export, owner):
    response = Client().get(f"/api/exports/{queued_export.pk}/download/", **bearer(owner))
    assert response.status_code == 409
    error = _error(response)
    assert error["code"] == "not_ready"
    assert "queued" in error["message"]
    queued_export.refresh_from_db()
    assert queued_export.status == ExportStatus.QUEUED


# --- Every API path answers its errors in JSON -------------------------------------------------

def _sample_url(pattern) -> str:
    """The pattern's URL with a sample for each of its parameters."""
    samples = {"slug": "acme", "export_id": "00000000-0000-0000-0000-000000000000", "token": "not-a-token"}
    return "/api/" + str(pattern.pattern).replace("<slug:slug>", samples["slug"]).replace(
        "<uuid:export_id>", samples["export_id"]).replace("<str:token>", samples["token"])


@pytest.mark.parametrize("method", ["get", "post", "put", "patch", "delete"])
def test_every_api_url_answers_every_error_in_json(account, owner, method):
    from exports.urls import urlpatterns

    for pattern in urlpatterns:
        for auth in ({}, bearer(owner)):
            response = getattr(Client(), method)(_sample_url(pattern), **auth)
            if response.status_code >= 400:
                error = _error(response)
                assert error["code"] and error["message"], (pattern, method)


@pytest.mark.parametrize("path", ["/api/", "/api/nothing/here/", "/api/exports/not-a-uuid/",
                                  "/api/exports/00000000-0000-0000-0000-000000000000/unknown/"])
def test_a_path_no_api_url_matches_is_a_json_404(path):
    response = Client().get(path)
    assert response.status_code == 404
    assert _error(response) == {"code": "not_found", "message": "No such API path: see the API in README.md."}


def test_a_method_an_api_url_does_not_take_is_a_json_405_naming_the_allowed_ones(account, owner):
    response = Client().delete(URL, **bearer(owner))
    assert response.status_code == 405
    assert response["Allow"] == "POST"
    assert _error(response) == {"code": "method_not_allowed", "message": "DELETE is not allowed here; use POST."}


def test_an_unexpected_failure_in_the_api_is_a_json_500_without_its_details(queued_export, owner, monkeypatch):
    def broken(record):
        raise RuntimeError("postgres://app:hunter2@db/fairshare is down")

    monkeypatch.setattr("exports.api.export_json", broken)
    response = Client(raise_request_exception=False).get(f"/api/exports/{queued_export.pk}/", **bearer(owner))
    assert response.status_code == 500
    assert _error(response)["code"] == "internal_server_error"
    assert b"hunter2" not in response.content


def test_pages_outside_the_api_keep_djangos_own_error_pages():
    response = Client().get("/nothing-here/")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")
