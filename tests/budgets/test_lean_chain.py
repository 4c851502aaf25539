"""The lean chain: an account's run is recorded by its admission, in the same transaction as its
slot; what happens to that record when the admission fails after making it."""
import pytest

from budgets.models import Budget, Reservation, UsageDay
from scheduling.envelope import Envelope
from scheduling.models import Outcome, TaskRun
from scheduling.runtime import execute

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_run_whose_admission_failed_after_recording_it_is_still_recorded_and_charges_nothing(
    account, monkeypatch,
):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)

    def broken_slot(**kwargs):
        raise RuntimeError("the database refused the slot")

    monkeypatch.setattr("budgets.ledger.take_slot", broken_slot)
    execute(Envelope(job="tests.noop", account=account.pk, ref="lean/1").to_message())

    # The admission's transaction (with the run's insert) was rolled back; the run is recorded
    # all the same, as failed, and holds no slot and no CPU.
    run = TaskRun.objects.get(ref="lean/1")
    assert (run.outcome, run.error_class, run.account_id) == (Outcome.FAILED, "RuntimeError", account.pk)
    assert run.finished_at is not None
    assert not Reservation.objects.exists()
    assert not UsageDay.objects.filter(cpu_reserved_ms__gt=0).exists()
