"""The generic runner django-q2 executes: every message ends as one inspectable TaskRun, and no
exception (with its customer data) ever escapes to django-q2's own failure records."""
import os
import time
import uuid

import pytest
from django.db import connection, transaction
from django_q.models import OrmQ, Task
from django_q.tasks import async_task

from scheduling.models import Outcome, TaskRun
from scheduling.registry import job
from scheduling.runtime import RUNNER, enqueue, execute
from tests.conftest import wait_for

pytestmark = pytest.mark.django_db


# Jobs known only to this process (a real worker would not know them: see the last tests).

@job("tests.runner.noop", queue="default")
def noop(ctx) -> None:
    ctx.items = 7


@job("tests.runner.nothing_to_do", queue="default")
def nothing_to_do(ctx) -> None:
    ctx.outcome = Outcome.SKIPPED


@job("tests.runner.boom", queue="default")
def boom(ctx) -> None:
    ctx.items = 2
    raise ValueError("card 4111111111111111 for bob@example.com")


@job("tests.runner.spin", queue="default")
def spin(ctx) -> None:
    # Burn ~0.3 s of this process's CPU time (not wall time: a busy machine just takes longer).
    start = time.process_time()
    while time.process_time() - start < 0.3:
        pass


@job("tests.runner.allocate", queue="default")
def allocate(ctx) -> None:
    block = bytearray(150 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])  # touched: resident


@job("tests.runner.query", queue="default")
def query(ctx) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_sleep(0.05)")


@job("tests.runner.system", queue="default", account_scoped=False)
def system(ctx) -> None:
    ctx.items = 1


def envelope(job: str, account: int | None, ref: str = "") -> dict:
    return {"v": 1, "job": job, "account": account, "ref": ref or str(uuid.uuid4())}


def only_run() -> TaskRun:
    runs = list(TaskRun.objects.all())
    assert len(runs) == 1, [(r.job, r.outcome, r.error_message) for r in runs]
    return runs[0]


# --- Contract failures: recorded as rejected, never raised ----------------------------------

@pytest.mark.parametrize(
    ("message", "expected_job", "reason"),
    [
        pytest.param("exports.build", "(malformed)", "envelope must be an object, got str", id="string"),
        pytest.param(None, "(malformed)", "envelope must be an object, got NoneType", id="none"),
        pytest.param({"v": 1, "job": "tests.runner.noop", "account": None}, "tests.runner.noop", "envelope is missing ref",
                     id="missing-ref"),
        pytest.param({"v": 1, "job": "tests.runner.noop", "account": None, "ref": "r", "timeout": 5}, "tests.runner.noop",
                     "envelope has 1 unexpected field(s)", id="extra-field"),
        # (A newer version is not unusable: it is parked for a newer worker, tests/scheduling/test_upgrades.py.)
        pytest.param({"v": 0, "job": "exports.build", "account": None, "ref": "r"}, "exports.build",
                     "unsupported envelope version 0 (this worker speaks v1 to v2)", id="v0"),
        pytest.param({"v": 1, "job": "tests.nope", "account": None, "ref": "r"}, "tests.nope", "unknown job",
                     id="unknown-job"),
    ],
)
def test_an_unusable_message_is_recorded_as_one_rejected_run_saying_why(message, expected_job, reason):
    execute(message)  # must not raise: django-q2 would store the traceback

    run = only_run()
    assert run.outcome == Outcome.REJECTED
    assert run.job == expected_job
    assert run.error_class in {"scheduling.envelope.ContractError", "scheduling.registry.UnknownJob"}
    assert reason in run.error_message
    assert run.started_at is not None and run.finished_at is not None


def test_an_unknown_job_is_rejected_as_an_unknown_job():
    execute(envelope("tests.does_not_exist", None))

    run = only_run()
    assert run.error_class == "scheduling.registry.UnknownJob"
    assert run.job == "tests.does_not_exist"


def test_a_rejected_message_keeps_its_account_when_the_account_exists(account):
    execute({"v": 0, "job": "exports.build", "account": account.pk, "ref": "r"})

    assert only_run().account == account


def test_a_rejected_message_naming_a_missing_account_is_still_recorded():
    execute({"v": 0, "job": "exports.build", "account": 987_654, "ref": "r"})

    run = only_run()
    assert run.outcome == Outcome.REJECTED and run.account is None


def test_a_rejected_message_does_not_store_customer_data_it_carried():
    execute({"v": 0, "job": "exports.build", "account": None, "ref": "carol@example.com 4111111111111111"})

    run = only_run()
    assert run.outcome == Outcome.REJECTED
    assert "carol" not in run.ref and "4111111111111111" not in run.ref


def test_a_rejected_message_keeps_an_export_id_ref_intact_so_the_export_can_be_found():
    export_id = "12345678-4a57-4c1e-9d0a-123456789012"  # all-digit segments, as ~1 in 40 ids have

    execute({"v": 0, "job": "exports.build", "account": None, "ref": export_id})

    assert only_run().ref == export_id


def test_an_account_scoped_job_without_an_account_is_rejected():
    execute(envelope("tests.runner.noop", None))

    run = only_run()
    assert run.outcome == Outcome.REJECTED
    assert run.error_class == "scheduling.envelope.ContractError"
    assert "needs an account" in run.error_message


# --- Registered jobs: run through the chain, metered and recorded ----------------------------

def test_a_job_runs_and_is_recorded_as_succeeded_with_its_items(account):
    ref = str(uuid.uuid4())

    execute(envelope("tests.runner.noop", account.pk, ref))

    run = only_run()
    assert run.outcome == Outcome.SUCCEEDED
    assert (run.job, run.queue, run.account, run.ref) == ("tests.runner.noop", "default", account, ref)
    assert run.items == 7
    assert run.cpu_ms >= 0 and run.wall_ms >= 0
    assert run.finished_at >= run.started_at
    assert run.worker.endswith(f":{os.getpid()}")
    assert run.error_class == "" and run.error_message == ""


def test_a_system_job_runs_without_an_account():
    execute(envelope("tests.runner.system", None))

    run = only_run()
    assert run.outcome == Outcome.SUCCEEDED and run.account is None and run.items == 1


def test_a_handler_that_finds_nothing_to_do_is_recorded_as_skipped(account):
    execute(envelope("tests.runner.nothing_to_do", account.pk))

    assert only_run().outcome == Outcome.SKIPPED


def test_a_failing_handler_is_recorded_as_failed_with_a_redacted_message_and_does_not_raise(account):
    execute(envelope("tests.runner.boom", account.pk))

    run = only_run()
    assert run.outcome == Outcome.FAILED
    assert run.error_class == "ValueError"
    assert run.error_message == "card *** for ***@***"
    assert "4111" not in run.error_message and "bob@example.com" not in run.error_message
    # What the handler did before it failed is kept.
    assert run.items == 2


def test_cpu_time_spent_by_the_handler_is_recorded(account):
    execute(envelope("tests.runner.spin", account.pk))

    run = only_run()
    assert run.outcome == Outcome.SUCCEEDED
    assert run.cpu_ms >= 200
    # Wall time covers the CPU time (a process cannot use more than one core's worth here).
    assert run.wall_ms >= run.cpu_ms - 5


def test_each_run_records_its_own_peak_memory(account):
    """The peak RSS is reset at each run's start (Linux: /proc/self/clear_refs), so a run after a
    greedy one records its own, smaller peak."""
    execute(envelope("tests.runner.allocate", account.pk, ref="greedy"))
    execute(envelope("tests.runner.noop", account.pk, ref="after"))

    greedy, after = (TaskRun.objects.get(ref=ref).peak_rss_kb for ref in ("greedy", "after"))
    assert greedy >= after + 140 * 1024 and after > 0


def test_time_waiting_on_the_database_is_recorded_apart_from_cpu_time(account):
    execute(envelope("tests.runner.query", account.pk))

    run = only_run()
    assert run.outcome == Outcome.SUCCEEDED
    # pg_sleep(0.05) keeps the query busy for at least 50 ms while this process waits.
    assert run.db_wait_ms >= 45
    assert run.cpu_ms < run.db_wait_ms


def test_every_delivery_gets_its_own_run_record(account):
    message = envelope("tests.runner.noop", account.pk)

    execute(message)
    execute(message)  # a duplicate delivery (the ORM broker is at-least-once)

    assert TaskRun.objects.filter(ref=message["ref"], outcome=Outcome.SUCCEEDED).count() == 2


def test_running_a_task_inline_inside_a_transaction_leaves_the_callers_transaction_usable(account):
    # django-q2's sync mode (and any inline call) runs the task inside the caller's transaction.
    with transaction.atomic():
        account.name = "Renamed inside the transaction"
        account.save()
        execute(envelope("tests.runner.noop", account.pk))

        account.refresh_from_db()
        assert account.name == "Renamed inside the transaction"
    assert only_run().outcome == Outcome.SUCCEEDED


# --- A real worker process ------------------------------------------------------------------

@pytest.mark.processes
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_records_unusable_messages_as_rejected_runs_and_stores_no_failure(account, start_cluster):
    cluster = start_cluster("default")
    bad_version_ref = str(uuid.uuid4())

    # Enqueued the way a stale or foreign producer would: straight to django-q2, no validation.
    async_task(RUNNER, {"v": 0, "job": "exports.build", "account": account.pk, "ref": bad_version_ref})
    async_task(RUNNER, "not an envelope")
    async_task(RUNNER, {"v": 1, "job": "tests.runner.noop", "account": account.pk, "ref": "unknown-to-the-worker"})

    wait_for(lambda: TaskRun.objects.count() >= 3, timeout=60,
             message=f"three task runs; worker log:\n{cluster.log()}")
    runs = {run.ref: run for run in TaskRun.objects.all()}

    def diagnosis() -> str:
        rows = [(r.ref, r.job, r.outcome, r.worker, r.error_class, r.error_message) for r in TaskRun.objects.all()]
        failures = list(Task.objects.filter(success=False).values_list("func", "result"))
        return f"runs: {rows}\ndjango-q2 failures: {failures}\nworker log:\n{cluster.log()}"

    assert set(runs) == {bad_version_ref, "", "unknown-to-the-worker"}, diagnosis()
    bad_version = runs[bad_version_ref]
    assert bad_version.outcome == Outcome.REJECTED
    assert bad_version.job == "exports.build" and bad_version.account == account
    assert bad_version.error_class == "scheduling.envelope.ContractError"
    assert "unsupported envelope version 0" in bad_version.error_message

    malformed = runs[""]
    assert malformed.outcome == Outcome.REJECTED and malformed.job == "(malformed)"

    # A job registered only in this test module does not exist in the worker.
    unknown = runs["unknown-to-the-worker"]
    assert unknown.outcome == Outcome.REJECTED
    assert unknown.error_class == "scheduling.registry.UnknownJob"

    # They ran in the worker, not here.
    assert all(not run.worker.endswith(f":{os.getpid()}") for run in runs.values())
    # django-q2 saw three successes: all acknowledged, no failure (and no traceback) stored.
    wait_for(lambda: not OrmQ.objects.exists(), timeout=30,
             message=f"the broker to acknowledge every task; {diagnosis()}")
    assert not Task.objects.filter(success=False).exists(), diagnosis()
    assert TaskRun.objects.count() == 3, diagnosis()


def cluster_connections_idle() -> bool:
    """Other sessions on this test's database are open, and none is running a statement."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*), count(*) FILTER (WHERE state <> 'idle') FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        sessions, busy = cursor.fetchone()
    return sessions > 0 and busy == 0


@pytest.mark.processes
@pytest.mark.django_db(transaction=True)
def test_a_worker_whose_idle_database_connections_died_runs_its_next_task_normally(account, start_cluster):
    # A database failover or restart, or a proxy closing idle connections, between two tasks:
    # persistent connections are checked before reuse and replaced, so no task pays for it.
    cluster = start_cluster("default", FAIRSHARE_WORKERS="1")  # the same worker runs both tasks
    enqueue(job="tests.noop", account=account.pk, ref="before")
    wait_for(lambda: TaskRun.objects.filter(ref="before", outcome=Outcome.SUCCEEDED).exists(), timeout=60,
             message=f"the first task; worker log:\n{cluster.log()}")
    # The worker, pusher and monitor go idle, their connections kept open.
    wait_for(cluster_connections_idle, timeout=30, message="the cluster's connections to be idle")
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        assert cursor.fetchall(), "the cluster had no open database connections to kill"

    enqueue(job="tests.noop", account=account.pk, ref="after")
    wait_for(lambda: TaskRun.objects.filter(ref="after").exclude(outcome=Outcome.RUNNING).exists(), timeout=60,
             message=f"the second task; worker log:\n{cluster.log()}")
    assert list(TaskRun.objects.filter(ref="after").values_list("outcome", flat=True)) == [Outcome.SUCCEEDED]
    assert not Task.objects.filter(success=False).exists()
    # ...and django-q2's own processes (broker pusher, result monitor) did not trip over theirs.
    wait_for(lambda: not OrmQ.objects.exists(), timeout=30, message="the result to be acknowledged")
    assert "Traceback" not in cluster.log(), cluster.log()[-4000:]
