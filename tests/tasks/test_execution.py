"""A Django task call run through the whole kernel chain in this process, as a worker runs it
(contract, run recording, budget admission and settlement, retries): what the call records for
each way a task can end, and the TaskRun that metered it. The same behaviours with real `qcluster`
workers: test_worker.py."""
import asyncio

import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from budgets.models import Budget
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue, execute
from tasks.compat import TaskResultStatus, default_task_backend, task_finished, task_started
from tasks.models import TaskCall
from tests.tasks import functions as f
from tests.tasks.conftest import envelope, run_here

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("beating_workers")]


@pytest.fixture
def budget(account):
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=4)


def test_a_call_runs_to_successful_with_its_return_value(account, budget):
    result = f.echo.enqueue(1, [2], account=account, three=3)
    run_here(result)
    result.refresh()
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == {"args": [1, [2]], "kwargs": {"three": 3}}
    assert result.attempts == 1 and len(result.worker_ids) == 1 and result.errors == []
    assert result.enqueued_at <= result.started_at == result.last_attempted_at <= result.finished_at
    run = TaskRun.objects.get(ref=result.id)
    assert (run.job, run.account_id, run.outcome, run.items) == ("tasks.run.default", account.pk, Outcome.SUCCEEDED, 1)
    assert TaskCall.objects.get(pk=result.id).run_id == run.pk


def test_aget_result_and_arefresh_read_it_from_async_code(account, budget, close_async_connections):
    result = f.meaning_of_life.enqueue(account=account)
    run_here(result)

    async def read():
        fetched = await default_task_backend.aget_result(result.id)
        await result.arefresh()
        return fetched

    fetched = asyncio.run(read())
    assert (fetched.status, fetched.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    assert result.status == TaskResultStatus.SUCCESSFUL and result.return_value == 42


def test_a_failing_call_is_failed_with_its_class_and_a_redacted_traceback(account, budget):
    result = f.failing_value_error.enqueue(account=account)
    run_here(result)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    with pytest.raises(ValueError, match="Task failed"):
        result.return_value  # noqa: B018
    (error,) = result.errors
    assert error.exception_class is ValueError
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert error.traceback.endswith("ValueError: This task failed due to ValueError\n")

    secret = f.failing_with_secret.enqueue(account=account)
    run_here(secret)
    secret.refresh()
    traceback = secret.errors[0].traceback
    assert secret.errors[0].exception_class is RuntimeError
    assert "Dsn-pa55word" not in traceback and "planted.person" not in traceback
    assert traceback.endswith("RuntimeError: could not connect to postgres://***@db.internal:5432/prod for ***@***\n")
    assert TaskRun.objects.get(ref=secret.id).outcome == Outcome.FAILED


@pytest.mark.parametrize("task", [f.failing_system_exit, f.exit_task])
def test_system_exit_in_a_task_fails_the_call_and_not_the_worker(account, budget, task):
    result = task.enqueue(account=account)
    run_here(result)  # returns: the worker goes on
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert result.errors[0].exception_class is SystemExit
    assert TaskRun.objects.get(ref=result.id).outcome == Outcome.FAILED


@pytest.mark.parametrize(("task", "error", "words"), [
    (f.complex_return_value, TypeError, "is not JSON serializable (Unsupported type: function)"),
    (f.huge_return_value, ValueError, "more than the 65,536 allowed (FAIRSHARE_TASKS_MAX_RESULT_BYTES)"),
])
def test_a_return_value_that_cannot_be_stored_fails_the_call(account, budget, task, error, words):
    result = task.enqueue(account=account)
    run_here(result)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED
    assert issubclass(result.errors[0].exception_class, error)
    assert words in result.errors[0].traceback
    assert TaskCall.objects.get(pk=result.id).return_value is None


def test_async_tasks_run_on_their_own_event_loop(account, budget, close_async_connections):
    result = f.async_meaning.enqueue(0.01, account=account)
    run_here(result)
    result.refresh()
    assert (result.status, result.return_value) == (TaskResultStatus.SUCCESSFUL, 42)
    # ... with the async ORM, and the account's id asked for by name.
    slug = f.async_account_slug.enqueue(account=account)
    run_here(slug)
    slug.refresh()
    assert (slug.status, slug.return_value) == (TaskResultStatus.SUCCESSFUL, "acme")


def test_a_task_that_takes_context_sees_its_own_running_result(account, budget):
    result = f.get_context.enqueue(account=account)
    run_here(result)
    result.refresh()
    assert result.return_value == {"id": result.id, "attempt": 1, "workers": result.worker_ids}


def test_a_function_asking_for_its_account_gets_its_id(account, budget):
    result = f.whose.enqueue(account=account, label="invoice")
    run_here(result)
    result.refresh()
    assert result.return_value == "invoice for acme"


def test_the_signals_are_sent_around_the_run(account, budget):
    seen = []

    def started(sender, task_result, **kwargs):
        seen.append(("started", task_result.status, TaskCall.objects.get(pk=task_result.id).status))

    def finished(sender, task_result, **kwargs):
        seen.append(("finished", task_result.status, task_result.return_value))

    task_started.connect(started)
    task_finished.connect(finished)
    try:
        run_here(f.meaning_of_life.enqueue(account=account))
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(finished)
    assert seen == [("started", TaskResultStatus.RUNNING, TaskResultStatus.RUNNING),
                    ("finished", TaskResultStatus.SUCCESSFUL, 42)]


def test_a_duplicate_delivery_runs_the_call_once(account, budget):
    result = f.meaning_of_life.enqueue(account=account)
    run_here(result)
    execute(envelope(result))  # the ORM broker delivers at least once
    result.refresh()
    assert result.attempts == 1
    assert sorted(TaskRun.objects.filter(ref=result.id).values_list("outcome", flat=True)) == [
        Outcome.SKIPPED, Outcome.SUCCEEDED]


def test_a_call_costs_two_statements_more_than_a_job_and_no_transaction(account, budget):
    """Counts, not timings (bench/tasks_overhead.py has those): the claim and the completion,
    beside the chain's own admission and settlement (2 statements for a job, tests/budgets/
    test_lean_chain.py)."""
    run_here(f.noop.enqueue(account=account))  # the day's first run creates its ledger row
    message = envelope(f.noop.enqueue(account=account))
    with CaptureQueriesContext(connection) as queries:
        execute(message)
    statements = [q["sql"] for q in queries if q["sql"].strip().upper() not in {"BEGIN", "COMMIT", "ROLLBACK"}]
    assert len(statements) == 4, statements
    assert [s.split()[0] for s in statements if "tasks_taskcall" in s] == ["UPDATE", "UPDATE"]
    assert not any(q["sql"].strip().upper() == "COMMIT" for q in queries)


def test_an_enqueue_costs_one_statement_more_than_a_jobs(account, budget):
    """The call's insert, with its account's check in it, in the kernel's enqueue transaction."""
    f.noop.enqueue(account=account)  # warm: the account's first enqueue of the day
    with CaptureQueriesContext(connection) as queries:
        f.noop.enqueue(account=account)
    statements = [q["sql"] for q in queries if q["sql"].strip().upper() not in {"BEGIN", "COMMIT", "ROLLBACK"}]
    assert [s.split()[0:3] for s in statements if "tasks_taskcall" in s] == [["INSERT", "INTO", "tasks_taskcall"]]
    assert sum(q["sql"].strip().upper() == "COMMIT" for q in queries) == 1  # one transaction, the broker's too
    with CaptureQueriesContext(connection) as job_queries:
        enqueue(job="tests.noop", account=account.pk, ref="a job")
    assert len(statements) == len(job_queries) - 2 + 1  # (the job's BEGIN and COMMIT are in its log)


def test_a_transient_failure_waits_ready_for_its_retry_with_its_error_on_record(account, budget):
    result = f.flaky.enqueue(account=account)
    run_here(result)
    result.refresh()
    assert result.status == TaskResultStatus.READY and result.attempts == 1
    assert result.errors[0].exception_class is ConnectionError
    held = DeferredTask.objects.get(ref=result.id)
    assert (held.job, held.reason) == ("tasks.run.default", DeferReason.RETRY_BACKOFF)
    assert TaskRun.objects.get(ref=result.id).outcome == Outcome.RETRYING


def test_a_run_stopped_at_the_daily_cap_gives_its_attempt_back_and_waits(account, budget):
    result = f.stopped_by_the_cap.enqueue(account=account)
    run_here(result)
    result.refresh()
    call = TaskCall.objects.get(pk=result.id)
    assert result.status == TaskResultStatus.READY and result.errors == []
    assert (call.attempt_count, len(call.worker_ids)) == (0, 1)  # it did start on that worker
    assert DeferredTask.objects.get(ref=result.id).reason == DeferReason.BUDGET_EXHAUSTED


@override_settings(TASKS={"default": {"BACKEND": "tasks.backend.FairshareBackend", "QUEUES": ["default"],
                                      "OPTIONS": {"SYSTEM_TASKS": ["tests.tasks.functions.flaky"]}}})
def test_a_transient_failure_the_retry_middleware_gives_up_on_fails_the_call_and_says_so():
    """System work is not retried: the job's on_give_up fails what the run left READY."""
    seen = []
    receiver = lambda sender, task_result, **kw: seen.append(task_result.status)  # noqa: E731
    task_finished.connect(receiver)
    try:
        result = f.flaky.enqueue()
        run_here(result)
    finally:
        task_finished.disconnect(receiver)
    result.refresh()
    assert result.status == TaskResultStatus.FAILED and result.finished_at is not None
    assert result.errors[0].exception_class is ConnectionError
    assert seen == [TaskResultStatus.FAILED]
    assert TaskRun.objects.get(ref=result.id).outcome == Outcome.FAILED

