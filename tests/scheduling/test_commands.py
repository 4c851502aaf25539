"""`manage.py export_status EXPORT_ID [--json]`: what a developer sees of one export."""
import datetime as dt
import io
import json
import uuid

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from exports.models import AttemptOutcome, ExportAttempt, ExportRecord, ExportStatus

pytestmark = pytest.mark.django_db


def export_status(*args) -> str:
    out = io.StringIO()
    call_command("export_status", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def failed_then_succeeded(account, owner):
    """An export that failed once (transient) and then succeeded on its second attempt."""
    record = ExportRecord.objects.create(
        account=account, requested_by=owner, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 31),
        source="activity", status=ExportStatus.SUCCEEDED, attempt_count=2, lease_epoch=2,
        output_key=f"exports/{account.pk}/x.csv", checksum_sha256="ab" * 32, row_count=1234, byte_size=56_789,
        rows_written=1234, rows_estimated=1200, completed_at=timezone.now(),
    )
    ExportAttempt.objects.create(
        export=record, number=1, epoch=1, outcome=AttemptOutcome.FAILED, rows_written=500,
        error_class="django.db.utils.OperationalError", error_message="connection to server lost",
        finished_at=timezone.now(),
    )
    ExportAttempt.objects.create(
        export=record, number=2, epoch=2, outcome=AttemptOutcome.SUCCEEDED, rows_written=1234,
        finished_at=timezone.now(),
    )
    return record


def test_text_output_shows_the_status_result_and_every_attempt(failed_then_succeeded):
    record = failed_then_succeeded

    output = export_status(str(record.pk))

    assert f"export   {record.pk}" in output
    assert "account  acme" in output and "range 2026-03-01..2026-03-31" in output
    assert "status   succeeded (100%)" in output
    assert f"result   1234 rows, 56789 bytes, sha256 {'ab' * 32}" in output
    attempt_lines = [line for line in output.splitlines() if line.startswith("attempt")]
    assert len(attempt_lines) == 2
    assert "#1 failed rows=500" in attempt_lines[0]
    assert "django.db.utils.OperationalError: connection to server lost" in attempt_lines[0]
    assert "#2 succeeded rows=1234" in attempt_lines[1]


def test_a_queued_export_shows_queued_and_no_attempts(account, owner):
    record = ExportRecord.objects.create(
        account=account, requested_by=owner, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 2),
        source="activity",
    )

    output = export_status(str(record.pk))

    assert "status   queued" in output
    assert "attempt" not in output and "result" not in output


def test_a_failed_export_shows_its_stored_error(account, owner):
    record = ExportRecord.objects.create(
        account=account, requested_by=owner, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 2),
        source="activity", status=ExportStatus.FAILED, attempt_count=1,
        error_class="exports.build.ExportNotAuthorised", error_message="requester is no longer a member",
    )

    output = export_status(str(record.pk))

    assert "status   failed" in output
    assert "error    exports.build.ExportNotAuthorised: requester is no longer a member" in output


def test_json_output_parses_and_carries_status_attempts_and_the_attempt_log(failed_then_succeeded):
    record = failed_then_succeeded

    data = json.loads(export_status(str(record.pk), "--json"))

    assert data["id"] == str(record.pk)
    assert data["account"] == "acme"
    assert data["status"] == "succeeded"
    assert data["attempts"] == 2
    assert data["row_count"] == 1234 and data["byte_size"] == 56_789
    assert data["links"]["download"] == f"/api/exports/{record.pk}/download/"
    log = data["attempt_log"]
    assert [(a["number"], a["outcome"], a["rows_written"]) for a in log] == [(1, "failed", 500), (2, "succeeded", 1234)]
    assert log[0]["error_class"] == "django.db.utils.OperationalError"
    assert all(dt.datetime.fromisoformat(a["started_at"]) and dt.datetime.fromisoformat(a["finished_at"]) for a in log)


def test_json_of_an_attempt_still_running_has_no_finish_time(account, owner):
    record = ExportRecord.objects.create(
        account=account, requested_by=owner, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 2),
        source="activity", status=ExportStatus.RUNNING, attempt_count=1, lease_epoch=1,
    )
    ExportAttempt.objects.create(export=record, number=1, epoch=1)

    data = json.loads(export_status(str(record.pk), "--json"))

    assert data["status"] == "running"
    assert data["attempt_log"][0]["outcome"] == "running"
    assert data["attempt_log"][0]["finished_at"] is None


def test_an_unknown_export_id_is_a_clear_error():
    missing = uuid.uuid4()

    with pytest.raises(CommandError, match=f"No export {missing}"):
        export_status(str(missing))


@pytest.mark.parametrize("bad", ["42", "not-a-uuid", "", "6f1c2a9e-4a57-4c1e-9d0a"])
def test_an_id_that_is_not_a_uuid_is_a_clear_error(bad):
    with pytest.raises(CommandError, match="is not an export id"):
        export_status(bad)
