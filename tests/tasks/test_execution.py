"""A Django task call run through the whole kernel chain in this process, as a worker runs it
(contract, run recording, budget admission and settlement, retries): what the call records for
each way a task can end, and the TaskRun that metered it. The same behaviours with real `qcluster`
workers: test_worker.py."""
import asyncio
import contextlib

import psycopg
import pytest
from django.db import connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from budgets.models import Budget
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause, TaskRun
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


def round_trips(run) -> list[list[str]]:
    """The statements `run()` sends, grouped by round trip: each statement on its own, or those of
    one pipeline (scheduling.db.send_along) together. In autocommit, with no COMMIT sent (no
    transaction opened), each round trip is one transaction: its statements, up to its one Sync."""
    sent: list[list[str]] = []
    piped = [False]
    pipeline = psycopg.Connection.pipeline

    @contextlib.contextmanager
    def counted(self):
        with pipeline(self) as p:
            sent.append([])
            piped[0] = True
            try:
                yield p
            finally:
                piped[0] = False

    def record(execute, sql, params, many, context):
        (sent[-1] if piped[0] else sent.append([]) or sent[-1]).append(sql)
        return execute(sql, params, many, context)

    with pytest.MonkeyPatch.context() as patch, CaptureQueriesContext(connection) as queries:
        patch.setattr(psycopg.Connection, "pipeline", counted)
        with connection.execute_wrapper(record):
            run()
    assert not any(q["sql"].strip().upper() in {"BEGIN", "COMMIT"} for q in queries)
    return sent


def label(sql: str) -> str:
    for part, name in (("DELETE FROM budgets_reservation", "settlement"), ("INSERT INTO scheduling_taskrun", "admission"),
                       ("SET status = 'RUNNING'", "claim"), ("SET status = 'SUCCESSFUL'", "completion")):
        if part in sql:
            return name
    return sql


def test_a_call_costs_the_round_trips_and_transactions_of_a_job(account, budget):
    """Counts, not timings (bench/tasks_overhead.py has those): the call's claim and completion, 2
    statements, go in the round trips and transactions of the chain's admission and settlement (2
    for a job, tests/budgets/test_lean_chain.py; before tasks.execution.CallMiddleware, 4 round
    trips and 4 transactions a call)."""
    run_here(f.noop.enqueue(account=account))  # the day's first run creates its ledger row
    message = envelope(f.noop.enqueue(account=account))
    sent = round_trips(lambda: execute(message))
    assert [[label(s) for s in trip] for trip in sent] == [["admission", "claim"], ["settlement", "completion"]], sent
    assert enqueue(job="tests.noop", account=account.pk, ref="a job") is not None
    job = round_trips(lambda: execute(Envelope(job="tests.noop", account=account.pk, ref="a job").to_message()))
    assert [len(trip) for trip in job] == [1, 1]


def test_without_prepared_statements_the_claim_and_the_completion_go_on_their_own(account, budget, settings):
    """FAIRSHARE["PREPARED_STATEMENTS"] False (a pooler that cannot keep them): no pipeline, each
    statement its own round trip, the same result."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "PREPARED_STATEMENTS": False}
    run_here(f.noop.enqueue(account=account))
    result = f.meaning_of_life.enqueue(account=account)
    message = envelope(result)
    sent = round_trips(lambda: execute(message))
    assert [[label(s) for s in trip] for trip in sent] == [
        ["admission"], ["claim"], ["settlement"], ["completion"]], sent
    result.refresh()
    assert (result.status, result.return_value, result.attempts) == (TaskResultStatus.SUCCESSFUL, 42, 1)


def test_a_call_whose_admission_finds_a_pause_stays_ready_as_it_was(account, budget):
    """Its claim went along with its admission, which admitted it and found the pause: given back
    untouched (no attempt, worker or start time), held until the pause is lifted."""
    result = f.echo.enqueue(account=account)
    message = envelope(result)
    Pause.objects.create(account=account, queue="default")
    execute(message)
    call = TaskCall.objects.get(pk=result.id)
    assert (call.status, call.attempt_count, call.workers, call.started_at, call.last_attempted_at) == (
        TaskResultStatus.READY, 0, "", None, None)
    assert DeferredTask.objects.get(ref=result.id).reason == DeferReason.PAUSED
    assert TaskRun.objects.get(ref=result.id).outcome == Outcome.DEFERRED


def test_a_completion_the_run_no_longer_held_the_call_for_records_the_run_skipped(account, budget):
    """The completion went along with the settlement, which recorded the run as it ended; the run
    had lost its call meanwhile (the reconciler gave it to another run): the call is not completed
    by it, no task_finished is sent, and the run is recorded skipped."""
    seen = []
    receiver = lambda sender, task_result, **kw: seen.append(task_result.id)  # noqa: E731
    task_finished.connect(receiver)
    try:
        result = f.superseded.enqueue(account=account)
        run_here(result)
    finally:
        task_finished.disconnect(receiver)
    call = TaskCall.objects.get(pk=result.id)
    assert (call.status, call.run_id) == (TaskResultStatus.RUNNING, None) and seen == []
    assert TaskRun.objects.get(ref=result.id).outcome == Outcome.SKIPPED


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

