"""A SECRET_KEY rotation seen by a real exports worker (scheduling/signatures.py): an export whose
message was signed with one of the worker's SECRET_KEY_FALLBACKS runs; one signed with a key the
worker does not have is recorded with its reason, and its export still completes, sent again at once
rather than minutes later by the reconciler (which does not run here: no default-queue worker)."""
import datetime as dt

import pytest
from django_q.conf import Conf

from exports.models import ExportStatus
from exports.requests import export_request
from scheduling.models import Outcome, TaskRun
from tests.exports.support import wait_finished, wait_runs_settled

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

OLD_KEY = "the-key-before-the-rotation"


def requested_with(key: str, monkeypatch, owner, day: int):
    """An export requested by a process whose SECRET_KEY is `key` (its message is signed with it)."""
    with monkeypatch.context() as m:
        m.setattr(Conf, "SECRET_KEY", key)
        record, _ = export_request(account_slug="acme", user=owner, start=dt.date(2026, 3, day),
                                   end=dt.date(2026, 3, day))
    return record


@pytest.mark.parametrize("broker", ["orm", "redis"], indirect=True)
def test_messages_signed_with_a_fallback_or_an_unknown_key_both_get_their_export_done(
        broker, owner, start_exports, monkeypatch):
    cluster = start_exports(**broker.env, SECRET_KEY_FALLBACKS=f"unused,{OLD_KEY}")

    # One after the other: each goes through the broker (with the one worker busy, the second would
    # wait in the holding area and be handed to the worker without a message). Its export done is not
    # enough: the worker is idle once its run settled, which frees its slot.
    rotated = requested_with(OLD_KEY, monkeypatch, owner, day=1)
    wait_finished(rotated, cluster, timeout=60)
    assert wait_runs_settled(rotated, cluster) == [Outcome.SUCCEEDED], list(
        TaskRun.objects.values_list("job", "ref", "outcome", "error_class", "error_message"))
    foreign = requested_with("a-key-no-worker-has", monkeypatch, owner, day=2)
    wait_finished(foreign, cluster, timeout=60)

    for record in (rotated, foreign):
        assert record.status == ExportStatus.SUCCEEDED, (record.error_message, cluster.tail())
    assert not TaskRun.objects.filter(job="exports.reconcile").exists()
    [rejected] = TaskRun.objects.filter(outcome=Outcome.REJECTED)
    assert (rejected.job, rejected.ref, rejected.account_id) == ("exports.build", str(foreign.pk), foreign.account_id)
    assert rejected.error_class == "scheduling.signatures.UnverifiedMessage"
    assert "SECRET_KEY_FALLBACKS verifies it" in rejected.error_message
    assert wait_runs_settled(foreign, cluster) == [Outcome.REJECTED, Outcome.SUCCEEDED]
    assert "Failed to push task to queue" not in cluster.log()  # django-q2's own silent drop
