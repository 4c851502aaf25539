"""API tokens scoped to one account, single-use download links, redacting log handlers and the
production HTTPS settings (issue 11)."""
import datetime as dt
import io
import logging
import os
import subprocess
import sys

import pytest
from django.test import Client
from django.utils import timezone

from budgets.models import ApiToken, Role
from config.logging import JsonFormatter
from exports.models import ExportRecord, ExportStatus
from scheduling.checks import check_logging_redacts
from scheduling.redaction import RedactingFilter, redact
from tests.conftest import REPO
from tests.factories import MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_accounts_one_user(account, other_account, owner):
    """acme-owner is also an owner of globex; each account has an export."""
    MembershipFactory(account=other_account, user=owner, role=Role.OWNER)
    exports = {a.slug: ExportRecord.objects.create(account=a, requested_by=owner, start_date=dt.date(2026, 3, 1),
                                                   end_date=dt.date(2026, 3, 1), source="activity")
               for a in (account, other_account)}
    return exports


def _auth(raw: str) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def test_a_token_acts_only_for_its_own_account(account, other_account, owner, two_accounts_one_user):
    token, raw = ApiToken.issue(user=owner, account=account, name="acme-ci")
    own, other = two_accounts_one_user["acme"], two_accounts_one_user["globex"]
    assert Client().get(f"/api/exports/{own.pk}/", **_auth(raw)).status_code == 200
    # The user may see globex's export; the token may not, and may not request one there.
    assert Client().get(f"/api/exports/{other.pk}/", **_auth(raw)).status_code == 404
    response = Client().post("/api/accounts/globex/exports/", data={"start": "2026-03-01", "end": "2026-03-01"},
                             content_type="application/json", **_auth(raw))
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_account"
    assert ExportRecord.objects.count() == 2
    token.refresh_from_db()
    assert token.last_used_at is not None


@pytest.mark.parametrize("state", ["revoked", "expired", "user inactive", "no account"])
def test_a_revoked_expired_or_orphaned_token_is_401(account, owner, two_accounts_one_user, state):
    token, raw = ApiToken.issue(user=owner, account=account, name="ci")
    if state == "revoked":
        ApiToken.objects.filter(pk=token.pk).update(revoked_at=timezone.now(), revoked_by=owner)
    elif state == "expired":
        ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    elif state == "user inactive":
        owner.is_active = False
        owner.save()
    else:
        ApiToken.objects.filter(pk=token.pk).update(account=None)
    response = Client().get(f"/api/exports/{two_accounts_one_user['acme'].pk}/", **_auth(raw))
    assert response.status_code == 401
    assert ApiToken.objects.filter(pk=token.pk).exists()  # kept, whatever its state


def test_an_unexpired_token_works_until_its_expiry(account, owner, two_accounts_one_user):
    _, raw = ApiToken.issue(user=owner, account=account, name="ci",
                            expires_at=timezone.now() + dt.timedelta(hours=1))
    assert Client().get(f"/api/exports/{two_accounts_one_user['acme'].pk}/", **_auth(raw)).status_code == 200


# --- Download links: single-use, short-lived, never in a log line -------------------------------

@pytest.fixture
def published(account, owner, export_root):
    record = ExportRecord.objects.create(account=account, requested_by=owner, start_date=dt.date(2026, 3, 1),
                                         end_date=dt.date(2026, 3, 1), source="activity",
                                         status=ExportStatus.SUCCEEDED, output_key="acme/file.csv")
    (export_root / "acme").mkdir()
    (export_root / "acme" / "file.csv").write_text("a,b\n1,2\n")
    return record


def _get_file(link: str):
    response = Client().get(link)
    body = b"".join(response.streaming_content) if response.streaming else response.content
    response.close()
    return response.status_code, body


@pytest.mark.django_db(transaction=True)  # a served file closes its request: real connections, as in production
def test_a_download_link_works_once(published, owner):
    link = Client().get(f"/api/exports/{published.pk}/download/", **_auth(
        ApiToken.issue(user=owner, account=published.account, name="t")[1]))["Location"]
    assert _get_file(link) == (200, b"a,b\n1,2\n")
    # Copied from a log, a proxy or a browser history afterwards: worth nothing (410 Gone: used).
    assert _get_file(link)[0] == 410


def test_links_and_tokens_never_reach_a_log_line(published, owner):
    _, raw = ApiToken.issue(user=owner, account=published.account, name="t")
    link = Client().get(f"/api/exports/{published.pk}/download/", **_auth(raw))["Location"]
    secret_part = link.rstrip("/").rsplit("/", 1)[1]
    out = io.StringIO()
    text = logging.StreamHandler(out)
    text.setFormatter(logging.Formatter("%(message)s"))
    json_handler = logging.StreamHandler(out)
    json_handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("django.server")
    for handler in (text, json_handler):
        handler.addFilter(RedactingFilter())
        logger.addHandler(handler)
    try:
        logger.info('"GET %s HTTP/1.1" 200 8', link, extra={"request_line": f"GET {link}"})
        try:
            raise ValueError(f"token {raw} rejected, password authentication failed")
        except ValueError:
            logger.exception("upstream said %s", raw)
    finally:
        for handler in (text, json_handler):
            logger.removeHandler(handler)
    written = out.getvalue()
    assert secret_part not in written and raw not in written
    assert "/api/exports/file/***/" in written and "password authentication failed" in written


def test_every_configured_log_handler_redacts():
    assert any(h.name == "console" for h in logging.getLogger().handlers)
    assert check_logging_redacts() == []
    bare = logging.StreamHandler(io.StringIO())
    bare.name = "added-without-the-filter"
    logging.getLogger("fairshare.somewhere").addHandler(bare)
    try:
        assert [e.id for e in check_logging_redacts()] == ["scheduling.E006"]
    finally:
        logging.getLogger("fairshare.somewhere").removeHandler(bare)


@pytest.mark.parametrize(("text", "kept"), [
    ('password authentication failed for user "app"', 'password authentication failed for user "app"'),
    ("token expired, please log in again", "token expired, please log in again"),
    ("basic authentication failed", "basic authentication failed"),
    ("The AWS Access Key Id AKIAIOSFODNN7EXAMPLE does not exist", "The AWS Access Key Id AKIA*** does not exist"),
    ("temporary ASIAY34FZKBOKMUTVV7A expired", "temporary ASIA*** expired"),
    ("caller fs_Zx81kq0aaBBBccc is unknown", "caller fs_*** is unknown"),
    ('{"password": "hunter2", "user": "app"}', '{"password": ***, "user": "app"}'),
    ("Processed 'scheduling.runtime.execute' for 'Carol Jones'", "Processed 'scheduling.runtime.execute' for '***'"),
])
def test_redaction_keeps_the_meaning_and_removes_the_secret(text, kept):
    assert redact(text) == kept


# --- The API, tried against another account as every role ----------------------------------------

@pytest.mark.parametrize("role", [Role.VIEWER, Role.OPERATOR, Role.OWNER])
@pytest.mark.parametrize("auth", ["token", "session"])
def test_every_role_is_refused_another_accounts_exports_through_the_api(account, other_account, role, auth,
                                                                        export_root):
    theirs = ExportRecord.objects.create(account=other_account, start_date=dt.date(2026, 3, 1),
                                         end_date=dt.date(2026, 3, 1), source="activity",
                                         status=ExportStatus.SUCCEEDED, output_key="globex/file.csv")
    user = MembershipFactory(account=account, user=UserFactory(username=f"acme-{role}"), role=role).user
    client, headers = Client(), {}
    if auth == "token":
        headers = _auth(ApiToken.issue(user=user, account=account, name="t")[1])
    else:
        client.force_login(user)
    before = list(ExportRecord.objects.values())

    for url in (f"/api/exports/{theirs.pk}/", f"/api/exports/{theirs.pk}/download/"):
        response = client.get(url, **headers)
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found", url
    response = client.post("/api/accounts/globex/exports/", data={"start": "2026-03-01", "end": "2026-03-01"},
                           content_type="application/json", **headers)
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_account"
    assert list(ExportRecord.objects.values()) == before


@pytest.mark.parametrize(("value", "expected"), [
    ("HTTP_X_FORWARDED_PROTO=https", "('HTTP_X_FORWARDED_PROTO', 'https')"),
    ("HTTP_X_FORWARDED_PROTO", "SECURE_PROXY_SSL_HEADER must look like HTTP_X_FORWARDED_PROTO=https."),
])
def test_the_proxy_ssl_header_is_read_from_the_environment(value, expected):
    env = {**os.environ, "SECURE_PROXY_SSL_HEADER": value, "DEBUG": "1"}
    result = subprocess.run([sys.executable, "manage.py", "shell", "-c",
                             "from django.conf import settings; print(settings.SECURE_PROXY_SSL_HEADER)"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert expected in result.stdout + result.stderr
