"""The hand-written statements every Django task call pays for (tasks/statements.py): what they
read on a large table (EXPLAIN). End to end through the kernel's chain they run in
test_execution.py (a call's insert, claim and completion) and test_backend.py (the insert's
refusal of an unknown account, nothing stored)."""
import json
import uuid

import pytest
from django.db import connection, transaction
from django.utils import timezone

from tasks import statements
from tasks.compat import TaskResultStatus
from scheduling.models import TaskRun
from tasks.models import TaskCall
from tests.scheduling.test_held_work_cost import generic_rows_read, rows_read

pytestmark = pytest.mark.django_db

ROWS = 20_000


def plan(sql: str, params: dict) -> str:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (FORMAT JSON) " + sql, params)
        return json.dumps(cursor.fetchone()[0])


def test_the_claim_and_the_completion_read_one_row_by_its_key_however_many_calls_are_kept(account):
    now = timezone.now()
    TaskCall.objects.bulk_create(
        TaskCall(backend="default", task_path="tests.tasks.functions.noop", account=account, queue="default",
                 arguments={"args": [], "kwargs": {}}, enqueued_at=now, sent_at=now,
                 status=(TaskResultStatus.SUCCESSFUL, TaskResultStatus.READY, TaskResultStatus.RUNNING)[i % 3])
        for i in range(ROWS))
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TaskCall._meta.db_table}")
    call_id = uuid.uuid4()
    claim = plan(statements.QUERIES["claim"], {"run_id": 1, "worker": "w:1\n", "now": now, "call_id": call_id})
    complete = plan(statements.QUERIES["complete"], {"return_value": '"x"', "now": now, "call_id": call_id,
                                                      "run_id": 1})
    for shown in (claim, complete):
        assert '"Index Name": "tasks_taskcall_pkey"' in shown and "Seq Scan" not in shown, shown
    new = TaskCall(backend="default", task_path="tests.tasks.functions.noop", account=account, queue="default",
                   arguments={"args": [], "kwargs": {}}, enqueued_at=now, sent_at=now)
    insert = plan(statements.QUERIES["insert"], {f.column: f.get_db_prep_save(f.pre_save(new, True), connection)
                                                 for f in statements._FIELDS})
    assert '"Index Name": "budgets_account_pkey"' in insert and "Seq Scan" not in insert, insert


def test_the_claim_sent_along_with_the_admission_reads_the_calls_runs_however_many_runs_are_kept(account):
    """`claim_along` finds the run the admission just recorded (by the call's ref, or its start
    time: an index each) with 100,000 runs on record, 3 of them the call's earlier attempts, in the
    plan for its values and in the generic plan a prepared statement settles on."""
    now = timezone.now()
    call = TaskCall.objects.create(backend="default", task_path="tests.tasks.functions.noop", account=account,
                                   queue="default", arguments={"args": [], "kwargs": {}}, enqueued_at=now, sent_at=now)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {TaskRun._meta.db_table} (account_id, job, queue, ref, worker, started_at, outcome, cpu_ms, "
            "wall_ms, db_wait_ms, storage_wait_ms, items, peak_rss_kb, error_class, error_message) "
            "SELECT %s, 'tasks.run.default', 'default', CASE WHEN i <= 3 THEN %s ELSE 'other-' || i END, 'w:1', "
            "%s - i * interval '1 second', CASE WHEN i = 0 THEN 'running' ELSE 'succeeded' END, 0, 0, 0, 0, 1, 0, "
            "'', '' FROM generate_series(0, 100000) AS i", [account.pk, str(call.pk), now])
        cursor.execute("ANALYZE")
    params = {"call_id": call.pk, "worker": "w:1\n", "now": now, "ref": str(call.pk), "job": "tasks.run.default",
              "run_worker": "w:1", "run_started_at": now}
    tables = (TaskRun._meta.db_table, TaskCall._meta.db_table)
    for name, read_with in (("custom", rows_read), ("generic", generic_rows_read)):
        with transaction.atomic():  # EXPLAIN ANALYZE runs it: each claim is undone
            read = read_with(statements.QUERIES["claim_along"], params, tables)
            assert TaskCall.objects.get(pk=call.pk).status == TaskResultStatus.RUNNING  # it found the run
            transaction.set_rollback(True)
        assert read[TaskRun._meta.db_table] <= 4 and read[TaskCall._meta.db_table] <= 3, (name, read)  # by key


def test_the_insert_names_every_column_of_a_call():
    """The insert lists TaskCall's columns itself: one the model gains must be added there."""
    listed = statements.QUERIES["insert"].split("(", 1)[1].split(")", 1)[0]
    assert {c.strip() for c in listed.split(",")} == {f.column for f in TaskCall._meta.concrete_fields}
