"""The hand-written statements every Django task call pays for (tasks/statements.py): what they
read on a large table (EXPLAIN), and that they run on SQLite too (the zero-setup demo's database),
end to end through the kernel's chain."""
import json
import subprocess
import sys
import uuid

import pytest
from django.db import connection
from django.utils import timezone

from tasks import statements
from tasks.compat import TaskResultStatus
from tasks.models import TaskCall
from tests.conftest import REPO

pytestmark = pytest.mark.django_db

ROWS = 20_000


def plan(sql: str, params: list) -> str:
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
    claim = plan(statements._claim(), ["RUNNING", 1, "w:1\n", now, now, call_id, "READY"])
    complete = plan(statements._complete(), ["SUCCESSFUL", '"x"', now, call_id, "RUNNING", 1])
    for shown in (claim, complete):
        assert '"Index Name": "tasks_taskcall_pkey"' in shown and "Seq Scan" not in shown, shown
    new = TaskCall(backend="default", task_path="tests.tasks.functions.noop", account=account, queue="default",
                   arguments={"args": [], "kwargs": {}}, enqueued_at=now, sent_at=now)
    insert = plan(statements._insert(True), [f.get_db_prep_save(f.pre_save(new, True), connection)
                                             for f in statements._FIELDS])
    assert '"Index Name": "budgets_account_pkey"' in insert and "Seq Scan" not in insert, insert


SQLITE_SCRIPT = """
import django, os
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from budgets.models import Account
from scheduling.runtime import execute
from tasks.models import TaskCall
from tests.tasks import functions as f
account = Account.objects.create(slug="lite", name="Lite")
result = f.echo.enqueue(1, "two", account=account, three=3)
call = TaskCall.objects.get(pk=result.id)
execute({"v": 1, "job": "tasks.run.default", "account": account.pk, "ref": result.id})
result.refresh()
print(result.status, result.return_value == {"args": [1, "two"], "kwargs": {"three": 3}}, result.attempts)
try:
    f.noop.enqueue(account=999)
except Exception as exc:
    print(type(exc).__name__, exc.code, TaskCall.objects.count())
"""


@pytest.mark.processes
def test_the_statements_run_on_sqlite_too(tmp_path):
    env = {"DJANGO_SETTINGS_MODULE": "config.settings", "DEBUG": "1", "FAIRSHARE_VAR_DIR": str(tmp_path),
           "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "LOG_LEVEL": "WARNING", "Q_LOG_LEVEL": "WARNING"}
    done = subprocess.run([sys.executable, "-c", SQLITE_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-3:-1] == ["SUCCESSFUL True 1", "CallRefused account_unknown 1"], done.stdout
