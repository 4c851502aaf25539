"""FAIRSHARE["ENQUEUE_GATES"]: the kernel asks each listed gate before it sends account work, gives
back what they took when the broker refuses the message, and releases held work through them."""
import datetime as dt
import signal
import subprocess
import sys

import pytest
from django_q.models import OrmQ

from budgets import clock as budget_clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from scheduling import broker, clock
from scheduling.envelope import Envelope
from scheduling.gates import EnqueueGate
from scheduling.holding import hold, release_due
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import enqueue, enqueue_many
from tests.conftest import REPO, worker_env

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

calls: list[tuple] = []


class RecordingGate(EnqueueGate):
    """Admits everything; records what it is asked."""

    def admit(self, *, envelope, queue):
        calls.append(("admit", self, envelope.ref))
        return True

    def undo(self, *, envelope, queue):
        calls.append(("undo", self, envelope.ref))

    def release_due(self, *, idle_workers=None):
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

    monkeypatch.setattr(broker, "async_task", broker_down)

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


# --- enqueue_many: a flood in a few statements -----------------------------------------------

def test_enqueue_many_sends_what_fits_each_accounts_slots_and_holds_the_rest_in_order(account, other_account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=2)
    Budget.objects.create(account=other_account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    work = [(account.pk, f"0/a-{i}") for i in range(10)] + [(other_account.pk, "0/b-0")]

    sent = enqueue_many(job="tests.noop", work=work)

    assert [task_id is not None for task_id in sent] == [True, True] + [False] * 8 + [True]
    assert sorted(Reservation.objects.values_list("ref", flat=True)) == ["0/a-0", "0/a-1", "0/b-0"]
    held = list(DeferredTask.objects.filter(account=account).order_by("created_at", "id").values_list("ref", "reason"))
    assert held == [("0/a-2", DeferReason.CONCURRENCY_CAP)] + [(f"0/a-{i}", DeferReason.QUEUED_BEHIND) for i in range(3, 10)]
    assert UsageDay.objects.get(account=account, day=budget_clock.budget_day()).deferrals == 8
    # Behind its held work, the next flood waits too, whatever slots free up meanwhile.
    Reservation.objects.filter(account=account).delete()
    assert enqueue_many(job="tests.noop", work=[(account.pk, "0/a-10")]) == [None]


@pytest.mark.django_db(transaction=True)
def test_a_producer_killed_between_the_gates_and_the_broker_leaves_no_slot_taken(account, export_root):
    """With the ORM broker the dispatched slot and the message commit together: a producer that
    dies after the budget gate admitted its job and before the message was sent (fault point
    `before_send`, a real SIGKILL) leaves neither, so the account's one slot is free at once
    (it used to stay taken, by a job nobody would run, until its dispatch lease ran out)."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)
    script = f"from scheduling.runtime import enqueue; enqueue(job='tests.noop', account={account.pk}, ref='killed')"

    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", script], cwd=REPO, timeout=60,
                          env=worker_env(export_root, FAIRSHARE_FAULT="before_send"),
                          capture_output=True, text=True)

    assert done.returncode == -signal.SIGKILL, done.stderr
    assert not Reservation.objects.exists() and not OrmQ.objects.exists()
    assert enqueue(job="tests.noop", account=account.pk, ref="next") is not None  # the slot is free
    assert Reservation.objects.get().status == ReservationStatus.DISPATCHED


@pytest.mark.django_db(transaction=True)
def test_a_batch_the_broker_refuses_halfway_sends_and_holds_none_of_it(account, monkeypatch):
    """enqueue_many with the ORM broker: one transaction for the whole batch."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=2)
    real_send, sends = broker.async_task, []

    def second_refused(*args, **kwargs):
        sends.append(1)
        if len(sends) == 2:
            raise ConnectionError("broker unreachable")
        return real_send(*args, **kwargs)

    monkeypatch.setattr(broker, "async_task", second_refused)
    with pytest.raises(ConnectionError):
        enqueue_many(job="tests.noop", work=[(account.pk, f"b{i}") for i in range(4)])

    assert len(sends) == 2  # the first was sent, then rolled back with the rest
    assert not OrmQ.objects.exists() and not Reservation.objects.exists() and not DeferredTask.objects.exists()
    assert enqueue_many(job="tests.noop", work=[(account.pk, f"c{i}") for i in range(4)]).count(None) == 2
