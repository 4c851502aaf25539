"""The hand-written statements every Django task call pays for (tasks/statements.py): what they
read on a large table (EXPLAIN). End to end through the kernel's chain they run in
test_execution.py (a call's insert, claim and completion) and test_backend.py (the insert's
refusal of an unknown account, nothing stored)."""
import json
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from tasks import statements
from tasks.compat import TaskResultStatus
from tasks.models import TaskCall

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


def test_the_insert_names_every_column_of_a_call():
    """The insert lists TaskCall's columns itself: one the model gains must be added there."""
    listed = statements.QUERIES["insert"].split("(", 1)[1].split(")", 1)[0]
    assert {c.strip() for c in listed.split(",")} == {f.column for f in TaskCall._meta.concrete_fields}
