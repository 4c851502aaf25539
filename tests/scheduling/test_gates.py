"""FAIRSHARE["ENQUEUE_GATES"]: the kernel asks each listed gate before it sends account work, gives
back what they took when the broker refuses the message, and releases held work through them."""
import datetime as dt

import pytest
from django_q.models import OrmQ

from budgets.models import Reservation, ReservationStatus
from scheduling import clock, runtime
from scheduling.envelope import Envelope
from scheduling.holding import hold, release_due
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import enqueue

pytestmark = pytest.mark.django_db

calls: list[tuple] = []


class RecordingGate:
    """Admits everything; records what it is asked."""

    def admit(self, *, envelope, queue):
        calls.append(("admit", self, envelope.ref))
        return True

    def undo(self, *, envelope, queue):
        calls.append(("undo", self, envelope.ref))

    def release_due(self):
        calls.append(("release_due", self))
        return 0


class HoldingGate(RecordingGate):
    """Holds everything, as a gate that refuses must."""

    def admit(self, *, envelope, queue):
        calls.append(("admit", self, envelope.ref))
        hold(envelope=envelope, queue=queue, reason=DeferReason.CONCURRENCY_CAP, eligible_at=clock.now())
        return False


def gates(settings, *paths: str) -> None:
    settings.FAIRSHARE = {**settings.FAIRSHARE, "ENQUEUE_GATES": [f"{__name__}.{p}" for p in paths]}
    calls.clear()


def test_a_gate_that_refuses_keeps_the_job_out_of_the_broker_and_undoes_the_gates_before_it(settings, account):
    gates(settings, "RecordingGate", "HoldingGate")

    assert enqueue(job="tests.noop", account=account.pk, ref="r1") is None

    assert OrmQ.objects.count() == 0
    assert DeferredTask.objects.filter(ref="r1", reason=DeferReason.CONCURRENCY_CAP).exists()
    assert [(c[0], type(c[1]).__name__) for c in calls] == [
        ("admit", "RecordingGate"), ("admit", "HoldingGate"), ("undo", "RecordingGate")]


def test_gates_see_account_work_only(settings):
    gates(settings, "HoldingGate")

    assert enqueue(job="scheduling.prune_django_q", account=None, ref="nightly") is not None

    assert calls == [] and OrmQ.objects.count() == 1


def test_the_budget_gate_gives_the_slot_back_when_the_broker_refuses_the_message(account, monkeypatch):
    def broker_down(*args, **kwargs):
        raise ConnectionError("broker unreachable")

    monkeypatch.setattr(runtime, "async_task", broker_down)

    with pytest.raises(ConnectionError):
        enqueue(job="tests.noop", account=account.pk, ref="r1")

    assert not Reservation.objects.filter(ref="r1", status=ReservationStatus.DISPATCHED).exists()
    assert not DeferredTask.objects.exists()


def test_held_work_is_released_through_the_gates(settings):
    gates(settings, "RecordingGate")

    release_due()

    assert [c[0] for c in calls] == ["release_due"]


def test_without_gates_all_due_held_work_is_sent_again(settings, account, django_capture_on_commit_callbacks):
    gates(settings)
    now = clock.now()
    for ref, eligible_at in (("due", now), ("later", now + dt.timedelta(hours=1))):
        hold(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default",
             reason=DeferReason.RETRY_BACKOFF, eligible_at=eligible_at)

    with django_capture_on_commit_callbacks(execute=True):
        assert release_due() == 1

    assert list(DeferredTask.objects.values_list("ref", flat=True)) == ["later"]
    assert OrmQ.objects.count() == 1
