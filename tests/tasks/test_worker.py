"""Django task calls run by real `qcluster` workers (modelled on the django-tasks project's own
backend tests, so a host that switches backends sees the same behaviour): enqueue -> READY ->
RUNNING -> SUCCESSFUL with the return value; a failing task -> FAILED with its class and a redacted
traceback; SystemExit; a return value that cannot be stored; get_result of a missing or malformed
id; run_after held until then; priority order within an account; async tasks; queue isolation;
the three signals; an account at its cap or out of budget holds Django tasks like any other work;
a SIGKILL mid-task leaves a consistent result."""
import datetime as dt
import os
import signal

import pytest
from django.utils import timezone
from django_q.models import Task as DjangoQTask

from budgets import clock
from budgets.adjust import budget_adjust
from budgets.models import Budget, UsageDay
from budgets.reclaim import reclaim_expired
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.testing import TEST_SIGNAL_LOG
from tasks.compat import TaskResultDoesNotExist, TaskResultStatus, default_task_backend
from tasks.exceptions import ResultTooLarge, WorkerLost
from tasks.maintenance import reconcile_calls
from tasks.models import TaskCall
from tests.conftest import wait_for
from tests.tasks import functions as f

# Work is sent as in production with workers beating before it (their pulses may not have beaten yet).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes, pytest.mark.usefixtures("beating_workers")]

# Recovery in seconds instead of minutes (a dead worker's reservation expires after 2 s), and a
# fast pulse for released held work.
FAST = {"FAIRSHARE_RESERVATION_LEASE": "2", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5",
        "FAIRSHARE_RELEASE_POLL": "0.2"}
WAIT_S = 60


@pytest.fixture
def budget(account):
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=4)


@pytest.fixture
def signal_log(tmp_path):
    return tmp_path / "signals.log"


@pytest.fixture
def workers(start_cluster, signal_log):
    """Start a `qcluster` for a queue with FAST settings and the signal log."""

    def start(queue: str = "default", **env: str):
        return start_cluster(queue, **{**FAST, TEST_SIGNAL_LOG.env: str(signal_log), **env})

    return start


def status_of(result) -> str:
    result.refresh()
    return result.status


def finished(result, cluster):
    """Wait for the call to finish (either way); fail with the worker's log if it does not."""
    wait_for(lambda: status_of(result) in (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED), timeout=WAIT_S,
             message=f"{result.task.name} to finish:\n{cluster.tail(30)}")
    return result


def test_a_call_goes_ready_running_successful_with_its_return_value(account, budget, workers):
    slow = f.sleep_for.enqueue(1.5, account=account)
    answer = f.meaning_of_life.enqueue(account=account)
    assert (slow.status, answer.status) == (TaskResultStatus.READY, TaskResultStatus.READY)
    cluster = workers()

    wait_for(lambda: status_of(slow) == TaskResultStatus.RUNNING, timeout=WAIT_S, message="the call to run")
    assert slow.started_at is not None and slow.finished_at is None and slow.attempts == 1
    host, pid = slow.worker_ids[0].rsplit(":", 1)
    assert int(pid) != cluster.pid  # a worker process of the cluster, not its main one
    finished(slow, cluster)
    finished(answer, cluster)
    assert (slow.status, slow.return_value, answer.return_value) == (TaskResultStatus.SUCCESSFUL, 1.5, 42)
    assert slow.enqueued_at <= slow.started_at <= slow.finished_at and slow.errors == []
    # The run is recorded just after the call's result (the chain's end, after the handler returned).
    run = wait_for(lambda: TaskRun.objects.filter(ref=slow.id).exclude(outcome=Outcome.RUNNING).first(),
                   timeout=WAIT_S, message="the call's run to be recorded")
    assert (run.job, run.account_id, run.outcome, run.worker) == (
        "tasks.run.default", account.pk, Outcome.SUCCEEDED, slow.worker_ids[0])
    # Read back from any process, by id; an id that names no call names no result.
    assert default_task_backend.get_result(answer.id).return_value == 42
    for missing in ("00000000-0000-0000-0000-000000000000", "123", "'; DROP TABLE tasks_taskcall; --"):
        with pytest.raises(TaskResultDoesNotExist):
            f.meaning_of_life.get_result(missing)


def test_a_failing_call_is_failed_with_its_class_and_a_redacted_traceback(account, budget, workers):
    failing = f.failing_value_error.enqueue(account=account)
    secret = f.failing_with_secret.enqueue(account=account)
    cluster = workers()
    finished(failing, cluster)
    finished(secret, cluster)

    assert failing.status == TaskResultStatus.FAILED and failing.errors[0].exception_class is ValueError
    assert failing.errors[0].traceback.endswith("ValueError: This task failed due to ValueError\n")
    assert secret.errors[0].exception_class is RuntimeError
    assert "Dsn-pa55word" not in secret.errors[0].traceback and "planted.person" not in secret.errors[0].traceback
    # Not in the run's record, django-q2's tables or the worker's log either.
    assert "Dsn-pa55word" not in TaskRun.objects.get(ref=secret.id).error_message
    assert all("Dsn-pa55word" not in str(row.result) for row in DjangoQTask.objects.all())
    cluster.stop()
    assert "Dsn-pa55word" not in cluster.log() and "planted.person@example.com" not in cluster.log()


def test_system_exit_fails_the_call_and_the_worker_goes_on(account, budget, workers):
    exits = [f.failing_system_exit.enqueue(account=account), f.exit_task.enqueue(account=account)]
    cluster = workers(FAIRSHARE_WORKERS="1")
    for result in exits:
        finished(result, cluster)
        assert result.status == TaskResultStatus.FAILED and result.errors[0].exception_class is SystemExit
    after = finished(f.meaning_of_life.enqueue(account=account), cluster)
    assert after.return_value == 42
    # The same worker process ran all three: a task's exit() did not end it.
    assert {r.worker_ids[0] for r in (*exits, after)} == {after.worker_ids[0]}


def test_a_return_value_that_cannot_be_stored_fails_the_call(account, budget, workers):
    unstorable, huge = f.complex_return_value.enqueue(account=account), f.huge_return_value.enqueue(account=account)
    cluster = workers()
    finished(unstorable, cluster)
    finished(huge, cluster)
    assert unstorable.status == TaskResultStatus.FAILED and unstorable.errors[0].exception_class is TypeError
    assert "is not JSON serializable" in unstorable.errors[0].traceback
    assert huge.status == TaskResultStatus.FAILED and huge.errors[0].exception_class is ResultTooLarge
    assert TaskCall.objects.get(pk=huge.id).return_value is None


def test_async_tasks_run(account, budget, workers):
    answer = f.async_meaning.enqueue(0.2, account=account)
    slug = f.async_account_slug.enqueue(account=account)
    cluster = workers()
    assert finished(answer, cluster).return_value == 42
    assert finished(slug, cluster).return_value == "acme"


def test_run_after_holds_the_call_until_then(account, budget, workers):
    cluster = workers()
    finished(f.meaning_of_life.enqueue(account=account), cluster)  # the workers are up and pulsing
    run_after = timezone.now() + dt.timedelta(seconds=3)
    result = f.meaning_of_life.using(run_after=run_after).enqueue(account=account)
    held = DeferredTask.objects.get(ref=result.id)
    assert (held.reason, held.eligible_at) == (DeferReason.SCHEDULED, run_after)
    finished(result, cluster)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.started_at >= run_after


def test_run_after_of_a_brand_new_account_runs_at_its_time(account, workers):
    # No Budget row yet: the plan's rows are made when its work is first admitted or released.
    assert not Budget.objects.filter(account=account).exists()
    cluster = workers()
    run_after = timezone.now() + dt.timedelta(seconds=2)
    result = f.meaning_of_life.using(run_after=run_after).enqueue(account=account)
    finished(result, cluster)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.started_at >= run_after
    assert result.started_at - run_after < dt.timedelta(seconds=WAIT_S / 2)


def test_priority_orders_an_accounts_waiting_calls(account, workers):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=1)
    blocker = f.sleep_for.enqueue(1.0, account=account)  # takes the account's one slot
    low = f.meaning_of_life.using(priority=-50).enqueue(account=account)
    normal = f.meaning_of_life.enqueue(account=account)
    high = f.meaning_of_life.using(priority=50).enqueue(account=account)
    assert DeferredTask.objects.filter(ref__in=[low.id, normal.id, high.id]).count() == 3  # waiting, in order
    cluster = workers()
    for result in (blocker, low, normal, high):
        finished(result, cluster)
    assert blocker.finished_at <= high.started_at <= normal.started_at <= low.started_at
    assert {r.status for r in (blocker, low, normal, high)} == {TaskResultStatus.SUCCESSFUL}


def test_queues_are_isolated(account, budget, workers):
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=3600, max_concurrent=2)
    on_exports = f.on_exports.enqueue(account=account)
    on_default = f.meaning_of_life.enqueue(account=account)
    default_cluster = workers()
    finished(on_default, default_cluster)
    assert status_of(on_exports) == TaskResultStatus.READY  # the default queue's workers never take it
    exports_cluster = workers("exports")
    assert finished(on_exports, exports_cluster).return_value == "exports"
    assert TaskRun.objects.get(ref=on_exports.id).queue == "exports"
    assert TaskRun.objects.get(ref=on_default.id).queue == "default"


def test_the_three_signals_are_sent(account, budget, workers, signal_log):
    from tasks.compat import task_enqueued

    enqueued = []
    receiver = lambda sender, task_result, **kw: enqueued.append((sender.__name__, task_result.id))  # noqa: E731
    task_enqueued.connect(receiver)
    try:
        ok, failing = f.meaning_of_life.enqueue(account=account), f.failing_value_error.enqueue(account=account)
    finally:
        task_enqueued.disconnect(receiver)
    assert enqueued == [("FairshareBackend", ok.id), ("FairshareBackend", failing.id)]
    cluster = workers()
    finished(ok, cluster)
    finished(failing, cluster)
    expected = {f"started {ok.id} RUNNING FairshareBackend", f"finished {ok.id} SUCCESSFUL FairshareBackend",
                f"started {failing.id} RUNNING FairshareBackend", f"finished {failing.id} FAILED FairshareBackend"}
    # Written by the worker that ran them, just after it stored the call's state (which `finished` saw):
    # the last line may come a moment later.
    wait_for(lambda: expected <= set(signal_log.read_text().splitlines()), timeout=WAIT_S,
             message=f"the four signal lines in {signal_log}:\n{cluster.tail(30)}")


def test_an_account_at_its_cap_holds_django_tasks_like_any_other_work(account, workers):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=1)
    first, second = f.sleep_for.enqueue(1.0, account=account), f.sleep_for.enqueue(1.0, account=account)
    held = DeferredTask.objects.get(ref=second.id)
    assert held.reason == DeferReason.CONCURRENCY_CAP and second.status == TaskResultStatus.READY
    cluster = workers()
    finished(first, cluster)
    finished(second, cluster)
    assert first.finished_at <= second.started_at  # never both at once, with workers to spare
    assert (first.status, second.status) == (TaskResultStatus.SUCCESSFUL, TaskResultStatus.SUCCESSFUL)


def test_an_account_out_of_budget_holds_django_tasks_until_it_has_budget(account, other_account, owner, workers):
    budget = Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1, max_concurrent=2)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day(), cpu_used_ms=1000)
    result = f.meaning_of_life.enqueue(account=account)
    held = DeferredTask.objects.get(ref=result.id)
    assert held.reason == DeferReason.BUDGET_EXHAUSTED and held.eligible_at == clock.next_reset()
    cluster = workers()
    # The workers run other work meanwhile, and their pulses release due held work: not this.
    finished(f.meaning_of_life.enqueue(account=other_account), cluster)
    assert status_of(result) == TaskResultStatus.READY and not TaskRun.objects.filter(ref=result.id).exists()

    assert budget_adjust(user=owner, budget_id=budget.pk, cpu_seconds_per_day=3600, today_only=True).ok
    assert finished(result, cluster).return_value == 42  # released by a worker's pulse


@pytest.mark.parametrize("broker", ["orm", "redis"], indirect=True)
def test_a_sigkill_mid_task_leaves_a_consistent_result(account, budget, workers, broker):
    again = f.sleep_on_first_attempt.enqueue(30, account=account)
    last = f.sleep_on_first_attempt.enqueue(30, account=account)
    TaskCall.objects.filter(pk=last.id).update(attempt_limit=1)  # no attempt left after this one
    cluster = workers(FAIRSHARE_WORKERS="2", **broker.env)
    for result in (again, last):
        wait_for(lambda r=result: status_of(r) == TaskResultStatus.RUNNING, timeout=WAIT_S, message="both to run")
    for result in (again, last):
        os.kill(int(result.worker_ids[0].rsplit(":", 1)[1]), signal.SIGKILL)

    # The kernel finds the runs lost once their reservations' leases expire; the reconciler then
    # gives back the call with an attempt left and fails the other. Neither stays RUNNING.
    def both_lost() -> bool:
        reclaim_expired()  # the kernel's maintenance (scheduling.reclaim_leases, every minute)
        return TaskRun.objects.filter(ref__in=[again.id, last.id], outcome=Outcome.LOST).count() == 2

    wait_for(both_lost, timeout=WAIT_S, message="the killed runs to be found lost")
    assert reconcile_calls() == 2
    assert status_of(last) == TaskResultStatus.FAILED and last.errors[0].exception_class is WorkerLost
    finished(again, cluster)
    assert again.status == TaskResultStatus.SUCCESSFUL and again.return_value == "attempt 2"
    assert again.attempts == 2 and again.worker_ids[0] != again.worker_ids[1]
    assert [e.exception_class for e in again.errors] == [WorkerLost]
    assert reconcile_calls() == 0
