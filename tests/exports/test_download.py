"""Downloading a built export: authorised, membership re-checked, and time-limited (SPEC §4 Exports).

The export is built for real, in-process. transaction=True: the default "copy" strategy reads
through a second database connection, which sees only committed rows.
"""
import csv
import datetime as dt
import hashlib
import io
from decimal import Decimal

import pytest
from django.conf import settings
from django.core import signing
from django.test import Client

from budgets.models import Membership
from exports import storage
from exports.build import export_build
from exports.models import ExportStatus
from exports.requests import export_request
from scheduling.metering import Meter
from scheduling.models import Outcome
from tests.exports.support import bearer, download
from tests.factories import ActivityEventFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def succeeded_export(account, other_account, owner):
    ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 3, 2, 9, tzinfo=dt.UTC),
                         actor_email="ana@example.com", amount=Decimal("10.00"), description="first")
    ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 3, 3, 18, tzinfo=dt.UTC),
                         actor_email="bo@example.com", amount=Decimal("-7.25"), description="refund, partial")
    ActivityEventFactory(account=other_account, occurred_at=dt.datetime(2026, 3, 2, 9, tzinfo=dt.UTC),
                         description="someone else's")
    record, _ = export_request(account_slug="acme", user=owner, start=dt.date(2026, 3, 1), end=dt.date(2026, 3, 31))
    result = export_build(export_id=record.pk, account_id=account.pk, owner="test", meter=Meter())
    assert result.outcome == Outcome.SUCCEEDED and result.rows == 2
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED
    return record


def _published(record) -> bytes:
    with storage.export_storage().open(record.output_key, "rb") as f:
        return f.read()


def _link(record, user) -> str:
    response = Client().get(f"/api/exports/{record.pk}/download/", **bearer(user))
    assert response.status_code == 302
    assert response["Location"].startswith("/api/exports/file/")
    return response["Location"]


def _fetch(url: str):
    """GET a download link the way a browser would: read the whole body, then close the response."""
    response = Client().get(url)
    if response.streaming:
        b"".join(response.streaming_content)
    response.close()
    return response


def test_member_downloads_exactly_the_published_file(succeeded_export, owner):
    response, body = download(owner, succeeded_export)
    assert body == _published(succeeded_export)
    assert hashlib.sha256(body).hexdigest() == succeeded_export.checksum_sha256
    assert len(body) == succeeded_export.byte_size
    assert response["Content-Type"] == "text/csv; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="acme-activity-{succeeded_export.pk}.csv"'
    assert response["Cache-Control"] == "private, no-store"
    assert list(csv.reader(io.StringIO(body.decode()))) == [
        ["occurred_at", "actor_email", "event_type", "amount", "description"],
        ["2026-03-02T09:00:00Z", "ana@example.com", "invoice.paid", "10.00", "first"],
        ["2026-03-03T18:00:00Z", "bo@example.com", "invoice.paid", "-7.25", "refund, partial"],
    ]


def test_status_json_links_to_the_download_once_succeeded(succeeded_export, viewer):
    data = Client().get(f"/api/exports/{succeeded_export.pk}/", **bearer(viewer)).json()
    assert (data["status"], data["row_count"], data["progress_percent"]) == ("succeeded", 2, 100)
    assert data["checksum_sha256"] == succeeded_export.checksum_sha256
    assert data["links"]["download"] == f"/api/exports/{succeeded_export.pk}/download/"
    # Any member may download, not only the requester.
    assert _fetch(_link(succeeded_export, viewer)).status_code == 200


def test_signed_link_stops_working_after_its_ttl(succeeded_export, owner, monkeypatch):
    link = _link(succeeded_export, owner)
    ttl_s = settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"]
    real_time = signing.time.time

    monkeypatch.setattr(signing.time, "time", lambda: real_time() + ttl_s - 10)
    assert _fetch(link).status_code == 200

    monkeypatch.setattr(signing.time, "time", lambda: real_time() + ttl_s + 1)
    response = _fetch(link)
    assert response.status_code == 410
    assert response.json()["error"]["code"] == "link_expired"
    assert f"links last {ttl_s} s" in response.json()["error"]["message"]
    assert succeeded_export.checksum_sha256.encode() not in response.content


def test_a_used_link_answers_410_with_its_reason_in_json(succeeded_export, owner):
    link = _link(succeeded_export, owner)
    assert _fetch(link).status_code == 200
    response = _fetch(link)
    assert (response.status_code, response["Content-Type"]) == (410, "application/json")
    assert response.json()["error"] == {
        "code": "link_used",
        "message": "This download link was used already (a link works once). Ask for a new link: "
                   f"GET /api/exports/{succeeded_export.pk}/download/."}
    assert _fetch(_link(succeeded_export, owner)).status_code == 200  # a new link works


def test_a_link_whose_file_cannot_be_read_stays_unused(succeeded_export, owner, monkeypatch):
    link = _link(succeeded_export, owner)

    def unreachable(*args, **kwargs):
        raise ConnectionError("storage down")

    with monkeypatch.context() as m:
        m.setattr(type(storage.export_storage()), "open", unreachable)
        response = _fetch(link)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "storage_unavailable"
    assert _fetch(link).status_code == 200  # the same link, once storage is back


def test_link_dies_with_the_users_membership(succeeded_export, account, owner):
    link = _link(succeeded_export, owner)
    assert _fetch(link).status_code == 200

    Membership.objects.filter(user=owner, account=account).delete()
    response = _fetch(link)
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    # ...and no new link is handed out either.
    assert Client().get(f"/api/exports/{succeeded_export.pk}/download/", **bearer(owner)).status_code == 404


def test_link_dies_when_the_user_is_deactivated(succeeded_export, owner):
    link = _link(succeeded_export, owner)
    owner.is_active = False
    owner.save()
    assert _fetch(link).status_code == 404


def test_tampered_or_forged_link_is_404(succeeded_export, owner):
    link = _link(succeeded_export, owner)
    prefix, token = link.rstrip("/").rsplit("/", 1)
    middle = len(token) // 2
    flipped = token[:middle] + ("A" if token[middle] != "A" else "B") + token[middle + 1:]
    forged_salt = signing.dumps({"e": str(succeeded_export.pk), "u": owner.pk}, compress=True)
    for bad in (flipped, token[:-3], forged_salt, "nonsense"):
        response = _fetch(f"{prefix}/{bad}/")
        assert response.status_code == 404, bad
        assert response.json()["error"]["code"] == "invalid_link", bad
    assert _fetch(link).status_code == 200  # the genuine link still works


def test_another_accounts_member_cannot_get_a_link(succeeded_export, outsider):
    response = Client().get(f"/api/exports/{succeeded_export.pk}/download/", **bearer(outsider))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_another_accounts_member_cannot_use_a_link_made_for_them(succeeded_export, outsider):
    # Even a correctly signed link names a user who must still be able to see the export.
    token = signing.dumps({"e": str(succeeded_export.pk), "u": outsider.pk}, salt=storage.DOWNLOAD_SALT, compress=True)
    assert _fetch(f"/api/exports/file/{token}/").status_code == 404


def test_anonymous_download_is_401(succeeded_export):
    response = Client().get(f"/api/exports/{succeeded_export.pk}/download/")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "unauthenticated"
