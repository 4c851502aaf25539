"""TaskRun's indexes, written with every run, cut to those a read needs. A run's end changes no
indexed column any more (the rate window's index no longer carries the outcome), so its update can
stay on the row's page (a HOT update) and write no index entry; the account's own index goes
(taskrun_account_started leads with it), and so do PostgreSQL's pattern-matching copies of job's and
ref's (no query matches a prefix; the admin's search matches a substring, which no B-tree serves).

On PostgreSQL nothing is rebuilt under a lock that stops TaskRun's writes: job's and ref's indexes
are renamed, and the window's index is built again CONCURRENTLY under another name before the old
one goes (hence `atomic = False`). On SQLite (no covering or pattern indexes) the window's index
stays as it was."""
import django.db.models.deletion
from django.db import migrations, models

TABLE = "scheduling_taskrun"
# The names migration 0001 gave the indexes of `db_index=True` (Django's, from table and column).
JOB, REF, ACCOUNT = "scheduling_taskrun_job_884cb282", "scheduling_taskrun_ref_d12c827e", "scheduling_taskrun_account_id_f5497ff2"
WINDOW, WINDOW_COLUMNS = "taskrun_account_queue_started", "(account_id, queue, started_at DESC)"

POSTGRESQL_FORWARD = [
    f"DROP INDEX CONCURRENTLY IF EXISTS {JOB}_like",
    f"DROP INDEX CONCURRENTLY IF EXISTS {REF}_like",
    f"DROP INDEX CONCURRENTLY IF EXISTS {ACCOUNT}",
    f"ALTER INDEX {JOB} RENAME TO taskrun_job",
    f"ALTER INDEX {REF} RENAME TO taskrun_ref",
    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS taskrun_window_rebuilt ON {TABLE} {WINDOW_COLUMNS}",
    f"DROP INDEX CONCURRENTLY IF EXISTS {WINDOW}",
    f"ALTER INDEX taskrun_window_rebuilt RENAME TO {WINDOW}",
]
POSTGRESQL_BACKWARD = [
    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS taskrun_window_rebuilt ON {TABLE} {WINDOW_COLUMNS} INCLUDE (outcome)",
    f"DROP INDEX CONCURRENTLY IF EXISTS {WINDOW}",
    f"ALTER INDEX taskrun_window_rebuilt RENAME TO {WINDOW}",
    f"ALTER INDEX taskrun_ref RENAME TO {REF}",
    f"ALTER INDEX taskrun_job RENAME TO {JOB}",
    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {ACCOUNT} ON {TABLE} (account_id)",
    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {REF}_like ON {TABLE} (ref varchar_pattern_ops)",
    f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {JOB}_like ON {TABLE} (job varchar_pattern_ops)",
]
SQLITE_FORWARD = [
    f"DROP INDEX IF EXISTS {ACCOUNT}",
    f"DROP INDEX IF EXISTS {JOB}", f"CREATE INDEX taskrun_job ON {TABLE} (job)",
    f"DROP INDEX IF EXISTS {REF}", f"CREATE INDEX taskrun_ref ON {TABLE} (ref)",
]
SQLITE_BACKWARD = [
    "DROP INDEX IF EXISTS taskrun_ref", f"CREATE INDEX {REF} ON {TABLE} (ref)",
    "DROP INDEX IF EXISTS taskrun_job", f"CREATE INDEX {JOB} ON {TABLE} (job)",
    f"CREATE INDEX {ACCOUNT} ON {TABLE} (account_id)",
]


def _run(postgresql: list[str], sqlite: list[str]):
    def run(apps, schema_editor):
        vendor = schema_editor.connection.vendor
        if vendor not in ("postgresql", "sqlite"):
            raise NotImplementedError(f"migration 0018 has no index changes written for {vendor}")
        for statement in postgresql if vendor == "postgresql" else sqlite:
            schema_editor.execute(statement)
    return run


class Migration(migrations.Migration):
    atomic = False  # CREATE / DROP INDEX CONCURRENTLY

    dependencies = [
        ('budgets', '0010_budget_weight_and_rate'),
        ('scheduling', '0017_workers_busy'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[migrations.RunPython(_run(POSTGRESQL_FORWARD, SQLITE_FORWARD),
                                                      _run(POSTGRESQL_BACKWARD, SQLITE_BACKWARD))],
            state_operations=[
                migrations.RemoveIndex(model_name='taskrun', name='taskrun_account_queue_started'),
                migrations.AlterField(
                    model_name='taskrun',
                    name='account',
                    field=models.ForeignKey(blank=True, db_index=False, null=True,
                                            on_delete=django.db.models.deletion.SET_NULL, related_name='task_runs',
                                            to='budgets.account'),
                ),
                migrations.AlterField(model_name='taskrun', name='job', field=models.CharField(max_length=100)),
                migrations.AlterField(model_name='taskrun', name='ref', field=models.CharField(blank=True, max_length=64)),
                migrations.AddIndex(
                    model_name='taskrun',
                    index=models.Index(fields=['account', 'queue', '-started_at'], name='taskrun_account_queue_started'),
                ),
                migrations.AddIndex(model_name='taskrun', index=models.Index(fields=['job'], name='taskrun_job')),
                migrations.AddIndex(model_name='taskrun', index=models.Index(fields=['ref'], name='taskrun_ref')),
            ],
        ),
    ]
