"""Requesting an export: bad requests get a clear error and create nothing; good ones enqueue one
identifiers-only envelope on commit (SPEC §4 Exports, §3 Envelope)."""
import datetime as dt
import io
import json
import uuid

import pytest
from django.core.management import CommandError, call_command
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets.models import Role
from exports.models import ExportRecord, ExportStatus
from exports.requests import ExportRequestError, export_request
from tests.factories import ActivityEventFactory, MembershipFactory, UserFactory

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

MARCH_1 = dt.date(2026, 3, 1)
MARCH_31 = dt.date(2026, 3, 31)


def _request(**overrides):
    kwargs = {"account_slug": "acme", "start": MARCH_1, "end": MARCH_31}
    kwargs.update(overrides)
    return export_request(**kwargs)


def _queued_envelopes() -> list:
    """The argument tuples of every message waiting in the ORM broker."""
    return [SignedPackage.loads(message.payload)["args"] for message in OrmQ.objects.all()]


def _assert_rejected(capture, code: str, message_part: str, **overrides) -> ExportRequestError:
    with capture(execute=True) as callbacks:
        with pytest.raises(ExportRequestError) as excinfo:
            _request(**overrides)
    assert excinfo.value.code == code
    assert message_part in excinfo.value.message
    assert str(excinfo.value) == excinfo.value.message
    assert callbacks == []
    assert ExportRecord.objects.count() == 0
    assert OrmQ.objects.count() == 0
    return excinfo.value


# --- Rejected ---------------------------------------------------------------------------------

def test_unknown_account_is_rejected(owner, django_capture_on_commit_callbacks):
    _assert_rejected(django_capture_on_commit_callbacks, "unknown_account", "'initech'",
                     account_slug="initech", user=owner)


def test_non_member_is_rejected(account, outsider, django_capture_on_commit_callbacks):
    _assert_rejected(django_capture_on_commit_callbacks, "not_member", "not a member", user=outsider)


def test_viewer_may_not_export(viewer, django_capture_on_commit_callbacks):
    _assert_rejected(django_capture_on_commit_callbacks, "not_allowed", "does not allow exports", user=viewer)


def test_end_before_start_is_rejected(owner, django_capture_on_commit_callbacks):
    _assert_rejected(django_capture_on_commit_callbacks, "invalid_range", "start date is after the end date",
                     user=owner, start=dt.date(2026, 3, 2), end=dt.date(2026, 3, 1))


def test_range_over_the_default_maximum_of_366_days_is_rejected(owner, django_capture_on_commit_callbacks):
    start = dt.date(2025, 1, 1)
    _assert_rejected(django_capture_on_commit_callbacks, "range_too_large", "more than 366 days",
                     user=owner, start=start, end=start + dt.timedelta(days=366))


def test_a_range_of_exactly_366_days_is_accepted(owner):
    start = dt.date(2025, 1, 1)
    record, created = _request(user=owner, start=start, end=start + dt.timedelta(days=365))
    assert created and record.status == ExportStatus.QUEUED


def test_the_maximum_range_follows_settings(owner, settings, django_capture_on_commit_callbacks):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_MAX_RANGE_DAYS": 7}
    _assert_rejected(django_capture_on_commit_callbacks, "range_too_large", "more than 7 days",
                     user=owner, start=MARCH_1, end=dt.date(2026, 3, 8))

    record, created = _request(user=owner, start=MARCH_1, end=dt.date(2026, 3, 7))
    assert created and (record.start_date, record.end_date) == (MARCH_1, dt.date(2026, 3, 7))


def test_unknown_format_is_rejected(owner, django_capture_on_commit_callbacks):
    _assert_rejected(django_capture_on_commit_callbacks, "unsupported_format", "'xlsx'", user=owner, fmt="xlsx")


def test_unknown_source_is_rejected(owner, django_capture_on_commit_callbacks):
    error = _assert_rejected(django_capture_on_commit_callbacks, "unknown_source", "'payroll'",
                             user=owner, source="payroll")
    assert "activity" in error.message and "usage" in error.message  # tells the user what exists


def test_too_many_rows_is_rejected(account, owner, settings, django_capture_on_commit_callbacks):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_MAX_ROWS": 2}
    ActivityEventFactory.create_batch(3, account=account)
    _assert_rejected(django_capture_on_commit_callbacks, "too_many_rows", "holds 3 rows; the maximum is 2",
                     user=owner)


def test_rows_outside_the_range_or_account_do_not_count_towards_the_maximum(
    account, other_account, owner, settings,
):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_MAX_ROWS": 2}
    ActivityEventFactory.create_batch(2, account=account)  # 2026-03-01: inside
    ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 4, 1, tzinfo=dt.UTC))
    ActivityEventFactory(account=other_account)
    record, created = _request(user=owner)
    assert created and record.rows_estimated == 2


def test_inactive_account_is_rejected(account, owner, django_capture_on_commit_callbacks):
    account.is_active = False
    account.save()
    _assert_rejected(django_capture_on_commit_callbacks, "account_inactive", "not active", user=owner)


def test_idempotency_key_reused_with_a_different_scope_is_rejected(owner, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        first, _ = _request(user=owner, idempotency_key="nightly")

    for other_scope in ({"end": dt.date(2026, 3, 30)}, {"start": dt.date(2026, 3, 2)}, {"source": "usage"}):
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            with pytest.raises(ExportRequestError) as excinfo:
                _request(user=owner, idempotency_key="nightly", **other_scope)
        assert excinfo.value.code == "idempotency_key_reused"
        assert "different scope" in excinfo.value.message
        assert callbacks == []
    assert list(ExportRecord.objects.values_list("pk", flat=True)) == [first.pk]
    assert OrmQ.objects.count() == 1


# --- Accepted ---------------------------------------------------------------------------------

def test_accepted_request_enqueues_exactly_one_identifiers_only_envelope_on_commit(
    account, owner, django_capture_on_commit_callbacks,
):
    ActivityEventFactory(account=account, actor_email="secret-customer@example.com", description="private note")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        record, created = _request(user=owner)
    assert created
    assert OrmQ.objects.count() == 0  # nothing is enqueued before the commit
    assert len(callbacks) == 1
    callbacks[0]()

    assert _queued_envelopes() == [({"v": 2, "job": "exports.build", "account": account.pk, "ref": str(record.pk), "priority": 0},)]
    task = SignedPackage.loads(OrmQ.objects.get().payload)
    assert task["kwargs"] == {}
    assert "secret-customer" not in repr(task) and "private note" not in repr(task)

    record.refresh_from_db()
    assert record.status == ExportStatus.QUEUED
    assert (record.account, record.requested_by, record.start_date, record.end_date) == (account, owner, MARCH_1, MARCH_31)
    assert (record.format, record.source, record.rows_estimated) == ("csv", "activity", 1)


def test_superuser_without_membership_may_export(account, django_capture_on_commit_callbacks):
    admin = UserFactory(username="root", is_superuser=True, is_staff=True)
    with django_capture_on_commit_callbacks(execute=True):
        record, created = _request(user=admin)
    assert created and record.requested_by == admin
    assert _queued_envelopes() == [({"v": 2, "job": "exports.build", "account": account.pk, "ref": str(record.pk), "priority": 0},)]


def test_same_idempotency_key_returns_the_same_export(owner, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        first, first_created = _request(user=owner, idempotency_key="nightly-2026-03")
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        again, again_created = _request(user=owner, idempotency_key="nightly-2026-03")
    assert (first_created, again_created) == (True, False)
    assert again.pk == first.pk
    assert callbacks == []
    assert ExportRecord.objects.count() == 1
    assert OrmQ.objects.count() == 1


def test_different_accounts_use_the_same_idempotency_key_independently(
    account, other_account, owner, outsider, django_capture_on_commit_callbacks,
):
    with django_capture_on_commit_callbacks(execute=True):
        acme, acme_created = _request(user=owner, idempotency_key="nightly")
        globex, globex_created = _request(account_slug="globex", user=outsider, idempotency_key="nightly")
    assert acme_created and globex_created
    assert acme.pk != globex.pk
    assert (acme.account, globex.account) == (account, other_account)
    refs = sorted(envelope["ref"] for (envelope,) in _queued_envelopes())
    assert refs == sorted([str(acme.pk), str(globex.pk)])


# --- The request_export command ---------------------------------------------------------------

def _command(*args):
    stdout, stderr = io.StringIO(), io.StringIO()
    call_command("request_export", *args, stdout=stdout, stderr=stderr)
    return stdout.getvalue(), stderr.getvalue()


@pytest.mark.parametrize("bad_date", ["2026-13-01", "yesterday", "2026-02-30", "01/03/2026"])
def test_command_rejects_malformed_dates_and_creates_nothing(owner, bad_date, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with pytest.raises(CommandError, match=r"start: Use a date as YYYY-MM-DD\."):
            _command("--account", "acme", "--start", bad_date, "--end", "2026-03-31")
        with pytest.raises(CommandError, match=r"end: Use a date as YYYY-MM-DD\."):
            _command("--account", "acme", "--start", "2026-03-01", "--end", bad_date)
    assert callbacks == []
    assert ExportRecord.objects.count() == 0
    assert OrmQ.objects.count() == 0


def test_command_json_prints_the_export(account, owner, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        stdout, _ = _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31",
                             "--idempotency-key", "cli-1", "--json")
    data = json.loads(stdout)
    record = ExportRecord.objects.get()
    assert data["id"] == str(record.pk)
    assert uuid.UUID(data["id"]) == record.pk
    assert (data["account"], data["status"], data["start"], data["end"]) == ("acme", "queued", "2026-03-01", "2026-03-31")
    assert (data["format"], data["source"]) == ("csv", "activity")
    assert data["links"]["self"] == f"/api/exports/{record.pk}/"
    assert record.requested_by == owner and record.idempotency_key == "cli-1"
    assert OrmQ.objects.count() == 1


def test_command_without_json_prints_the_export_id_and_repeats_by_key(owner):
    first, _ = _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31",
                        "--idempotency-key", "cli-1")
    again, _ = _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31",
                        "--idempotency-key", "cli-1")
    record = ExportRecord.objects.get()
    assert first.strip() == f"Requested export {record.pk}"
    assert again.strip() == f"Already requested export {record.pk}"


def test_command_rejects_an_unknown_account(owner):
    with pytest.raises(CommandError, match=r"No account 'initech'"):
        _command("--account", "initech", "--start", "2026-03-01", "--end", "2026-03-31")
    with pytest.raises(CommandError, match=r"No account 'initech'.*unknown_account"):
        _command("--account", "initech", "--start", "2026-03-01", "--end", "2026-03-31", "--user", owner.username)
    assert ExportRecord.objects.count() == 0
    assert OrmQ.objects.count() == 0


def test_command_reports_the_services_rejection(account, viewer):
    with pytest.raises(CommandError, match=r"does not allow exports.*\(not_allowed\)"):
        _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31", "--user", viewer.username)
    assert ExportRecord.objects.count() == 0


def test_command_acts_as_a_named_member(account, owner):
    operator = MembershipFactory(account=account, user=UserFactory(username="acme-ops"), role=Role.OPERATOR).user
    _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31", "--user", "acme-ops")
    assert ExportRecord.objects.get().requested_by == operator
    with pytest.raises(CommandError, match=r"No user 'nobody'"):
        _command("--account", "acme", "--start", "2026-03-01", "--end", "2026-03-31", "--user", "nobody")
    assert ExportRecord.objects.count() == 1
