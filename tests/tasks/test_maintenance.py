"""The tasks app's maintenance: a call whose run was lost is given back or failed (never RUNNING
for ever), a call whose message was lost is sent again, finished calls are pruned after their
retention; and the schedules that run them."""
import datetime as dt

import pytest
from django.utils import timezone
from django_q.models import OrmQ

from budgets.models import Reservation
from scheduling.models import DeferredTask, Outcome, TaskRun
from scheduling.schedules import SCHEDULES
from tasks import calls
from tasks.compat import TaskResultStatus, task_finished
from tasks.exceptions import WorkerLost
from tasks.maintenance import prune_results, reconcile_calls
from tasks.models import TaskCall
from tests.tasks import functions as f

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def claimed_by_a_run_that(result, outcome: str) -> TaskCall:
    """The call claimed by a run of a worker, and that run then recorded with `outcome` by the
    kernel (`lost`: the reclaim of its lease or the sweep of silent workers found its worker dead)."""
    run = TaskRun.objects.create(job="tasks.run.default", ref=result.id, account_id=TaskCall.objects.get(
        pk=result.id).account_id, started_at=timezone.now(), worker="host:4242")
    claimed = calls.claim(call_id=result.id, worker="host:4242", run_id=run.pk)
    assert claimed is not None
    TaskRun.objects.filter(pk=run.pk).update(outcome=outcome)
    return claimed.call


def test_a_call_whose_run_was_lost_is_given_back_and_sent_again(account):
    result = f.sleep_for.enqueue(60, account=account)
    claimed_by_a_run_that(result, Outcome.LOST)
    OrmQ.objects.all().delete()  # the message went with the worker (Redis) or was acknowledged

    assert reconcile_calls() == 1
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.worker_ids == ["host:4242"]
    assert result.errors[0].exception_class is WorkerLost
    assert "the worker host:4242 stopped while the task ran" in result.errors[0].traceback
    assert OrmQ.objects.count() + DeferredTask.objects.count() == 1  # sent again (or held by its gates)
    assert reconcile_calls() == 0  # once


def test_a_call_still_running_is_left_alone(account):
    result = f.sleep_for.enqueue(60, account=account)
    claimed_by_a_run_that(result, Outcome.RUNNING)
    assert reconcile_calls() == 0
    result.refresh()
    assert result.status == TaskResultStatus.RUNNING


def test_a_lost_call_without_attempts_left_is_failed_and_finished(account):
    result = f.sleep_for.enqueue(60, account=account)
    TaskCall.objects.filter(pk=result.id).update(attempt_limit=1)
    claimed_by_a_run_that(result, Outcome.LOST)
    seen = []
    receiver = lambda sender, task_result, **kw: seen.append(task_result.status)  # noqa: E731
    task_finished.connect(receiver)
    try:
        assert reconcile_calls() == 1
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.finished_at is not None
    assert result.errors[0].exception_class is WorkerLost
    assert seen == [TaskResultStatus.FAILED]


def test_a_call_whose_run_record_is_gone_counts_as_lost(account):
    result = f.sleep_for.enqueue(60, account=account)
    call = claimed_by_a_run_that(result, Outcome.RUNNING)
    TaskRun.objects.filter(pk=call.run_id).delete()  # pruned by the kernel's roll-up
    assert reconcile_calls() == 1
    result.refresh()
    assert result.status == TaskResultStatus.READY


def test_a_ready_call_whose_message_was_lost_is_sent_again_once_stale(account, other_account, settings):
    lost = f.noop.enqueue(account=account)
    held = f.noop.enqueue(account=other_account)
    OrmQ.objects.all().delete()  # both messages gone, with the slots they held...
    Reservation.objects.all().delete()
    DeferredTask.objects.create(account=other_account, queue="default", job="tasks.run.default", ref=held.id,
                                reason="retry_backoff", eligible_at=timezone.now())  # ...but one is held
    assert reconcile_calls() == 0  # not stale yet
    stale = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["TASKS_STALE_AFTER_S"] + 1)
    TaskCall.objects.update(sent_at=stale)

    assert reconcile_calls() == 1
    assert [m.task["args"][0]["ref"] for m in OrmQ.objects.all()] == [lost.id]
    assert reconcile_calls() == 0  # its sent_at moved on, and its new message holds a slot


def test_a_stale_call_whose_slot_is_still_dispatched_is_left_to_the_kernel(
        account, settings, django_capture_on_commit_callbacks):
    """Its message may wait in a busy broker: the slot's dispatch lease decides, and the kernel
    holds the call again (message_lost) if it ends; no second message from here meanwhile."""
    with django_capture_on_commit_callbacks(execute=True):
        f.noop.enqueue(account=account)
    OrmQ.objects.all().delete()
    TaskCall.objects.update(sent_at=timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["TASKS_STALE_AFTER_S"] + 1))
    assert Reservation.objects.filter(status="dispatched").count() == 1
    assert reconcile_calls() == 0 and not OrmQ.objects.exists()


def test_finished_calls_are_pruned_after_their_retention(account):
    old, recent, waiting = (f.noop.enqueue(account=account) for _ in range(3))
    now = timezone.now()
    TaskCall.objects.filter(pk=old.id).update(status=TaskResultStatus.SUCCESSFUL, finished_at=now - dt.timedelta(days=8))
    TaskCall.objects.filter(pk=recent.id).update(status=TaskResultStatus.FAILED, finished_at=now - dt.timedelta(days=6))
    assert prune_results(older_than_days=7) == 1
    assert set(TaskCall.objects.values_list("pk", flat=True).iterator()) == {
        TaskCall.objects.get(pk=recent.id).pk, TaskCall.objects.get(pk=waiting.id).pk}


def test_the_maintenance_is_scheduled():
    jobs = {schedule.job for schedule in SCHEDULES}
    assert {"tasks.reconcile", "tasks.prune_results"} <= jobs
