"""Operator actions on exports: retry (same id, fresh attempts, history kept, one object and one
e-mail), cancel and run a recurring export now; each checks the role, reports per item and
writes Django's admin log."""
import datetime as dt

import pytest
from django.contrib.admin.models import LogEntry

from exports import build
from exports.models import AttemptOutcome, ExportRecord, ExportSchedule, ExportStatus
from exports.operations import export_cancel_by, export_retry, export_schedule_run_now
from exports.requests import BUILD_JOB, export_request
from scheduling.envelope import Envelope
from scheduling.models import Outcome
from scheduling.runtime import execute
from tests.exports.support import RANGE, add_events, attempts, object_key, runs, stored_files

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def _log(record) -> list[str]:
    return list(LogEntry.objects.filter(object_id=str(record.pk)).values_list("change_message", flat=True))


def _failed(account, **fields) -> ExportRecord:
    return ExportRecord.objects.create(
        account=account, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 2), source="activity",
        status=ExportStatus.FAILED, attempt_count=5, attempt_limit=5, error_class="ConnectionResetError",
        error_message="Connection reset by peer", **fields)


def test_retry_requeues_a_failed_export_with_a_fresh_attempt_budget(account, operator, django_capture_on_commit_callbacks):
    record = _failed(account)
    with django_capture_on_commit_callbacks() as sent:
        [result] = export_retry(user=operator, export_ids=[record.pk])
    assert result.ok and result.message == "queued again"
    record.refresh_from_db()
    assert (record.status, record.attempt_count, record.attempt_limit, record.error_class) == (
        ExportStatus.QUEUED, 5, 10, "")
    assert len(sent) == 1  # its build is enqueued once the retry commits
    assert _log(record) == ["Retried (was failed: ConnectionResetError)"]


def test_retry_reports_each_item_and_refuses_by_role(account, other_account, operator, viewer, root):
    failed, running = _failed(account), _failed(account, lease_epoch=1)
    ExportRecord.objects.filter(pk=running.pk).update(status=ExportStatus.RUNNING)
    elsewhere = _failed(other_account)

    results = export_retry(user=operator, export_ids=[failed.pk, running.pk, elsewhere.pk])
    assert [(r.ok, r.message) for r in results] == [
        (True, "queued again"),
        (False, "it is running; only failed or cancelled exports can be retried"),
        (False, "not found"),  # another tenant's export looks missing
    ]
    assert ExportRecord.objects.get(pk=elsewhere.pk).status == ExportStatus.FAILED
    assert _log(running) == [] and _log(elsewhere) == []

    [refused] = export_retry(user=viewer, export_ids=[running.pk])
    assert (refused.ok, refused.message) == (False, "your role (viewer) may not do this; it needs operator")
    [cancelled] = export_cancel_by(user=viewer, export_ids=[running.pk])
    assert not cancelled.ok and ExportRecord.objects.get(pk=running.pk).cancel_requested_at is None
    [superuser] = export_retry(user=root, export_ids=[elsewhere.pk])  # superusers act on every account
    assert superuser.ok


def test_cancel_by_an_operator_is_logged_and_a_finished_export_is_refused(account, operator):
    queued = ExportRecord.objects.create(account=account, start_date=dt.date(2026, 3, 1),
                                         end_date=dt.date(2026, 3, 1), source="activity")
    finished = _failed(account)
    results = export_cancel_by(user=operator, export_ids=[queued.pk, finished.pk])
    assert [(r.ok, r.message) for r in results] == [(True, "cancelled"), (False, "it is already failed")]
    assert ExportRecord.objects.get(pk=queued.pk).status == ExportStatus.CANCELLED
    assert _log(queued) == ["Cancel requested"] and _log(finished) == []


def test_run_a_recurring_export_now_requests_its_period_once(account, owner, operator, viewer):
    add_events(account, 3)
    schedule = ExportSchedule.objects.create(account=account, source="activity", requested_by=owner)
    first = export_schedule_run_now(user=operator, schedule_ids=[schedule.pk])
    again = export_schedule_run_now(user=operator, schedule_ids=[schedule.pk])
    assert first[0].ok and "requested" in first[0].message
    assert again[0].ok and "exists already" in again[0].message
    assert ExportRecord.objects.filter(account=account).count() == 1
    assert not export_schedule_run_now(user=viewer, schedule_ids=[schedule.pk])[0].ok
    assert LogEntry.objects.filter(object_id=str(schedule.pk), change_message__startswith="Ran now").count() == 2


@pytest.mark.django_db(transaction=True)
def test_retry_after_a_failure_past_publishing_keeps_one_object_and_sends_one_email(
        account, owner, operator, export_root, monkeypatch, mailoutbox):
    """The worst case for a retry: the first attempt published the file, then failed for good
    before completing. The retry completes from that object (same key, nothing published again)
    and the requester gets one e-mail."""
    add_events(account, 120)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    message = Envelope(job=BUILD_JOB, account=account.pk, ref=str(record.pk)).to_message()

    def fail_after_publish(point):
        if point == "after_publish":
            raise ValueError("the record could not be completed")  # terminal: no automatic retry
    monkeypatch.setattr(build, "fault_point", fail_after_publish)
    execute(message)
    record.refresh_from_db()
    assert record.status == ExportStatus.FAILED and record.error_class == "ValueError"
    assert stored_files(export_root) == [object_key(record), object_key(record) + ".manifest.json"]
    assert mailoutbox == []

    monkeypatch.undo()
    [result] = export_retry(user=operator, export_ids=[record.pk])
    assert result.ok
    execute(message)  # the build the retry enqueued (its broker message waits for no worker here)
    execute(message)  # and a duplicate delivery of it

    record.refresh_from_db()
    assert (record.status, record.row_count) == (ExportStatus.SUCCEEDED, 120)
    assert stored_files(export_root) == [object_key(record), object_key(record) + ".manifest.json"]
    assert attempts(record) == [AttemptOutcome.FAILED, AttemptOutcome.RECONCILED]  # history kept
    assert runs(record) == [Outcome.FAILED, Outcome.SUCCEEDED, Outcome.SKIPPED]
    assert len(mailoutbox) == 1 and str(record.pk) in mailoutbox[0].body


def test_retry_through_the_api_and_the_command(client, account, operator, viewer, capsys):
    from django.core.management import CommandError, call_command

    from tests.exports.support import bearer
    record = _failed(account)
    assert client.post(f"/api/exports/{record.pk}/retry/", **bearer(viewer)).json()["error"]["code"] == "not_allowed"
    response = client.post(f"/api/exports/{record.pk}/retry/", **bearer(operator))
    assert response.status_code == 202 and response.json()["status"] == "queued"
    again = client.post(f"/api/exports/{record.pk}/retry/", **bearer(operator))
    assert again.status_code == 409 and again.json()["error"]["code"] == "not_retryable"

    ExportRecord.objects.filter(pk=record.pk).update(status=ExportStatus.CANCELLED)
    call_command("retry_export", str(record.pk), "--user", "acme-operator")
    assert "queued again" in capsys.readouterr().out
    with pytest.raises(CommandError):
        call_command("retry_export", str(record.pk), "--user", "acme-operator")
    assert LogEntry.objects.filter(object_id=str(record.pk), user=operator).count() == 2
