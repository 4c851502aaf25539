"""Rate limits: the holding area's reason "rate limited", its count in Backlog (the triggers that
keep Backlog's counts rewritten with it), and TaskRun's index for a rate limit's window: an
account's latest starts on a queue. (On a large TaskRun table, build that index CONCURRENTLY by
hand before migrating, with the definition below; this migration then finds it by name and keeps
it.)"""
from django.db import migrations, models

from scheduling.migrations import _triggers as triggers

BEFORE = triggers.Triggers(("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
                            "queued_behind", "paused", "message_lost", "needs_newer_worker"))
AFTER = triggers.Triggers((*BEFORE.reasons, "rate_limited"))


RUN_WINDOW = models.Index(fields=["account", "queue", "-started_at"], include=("outcome",),
                          name="taskrun_account_queue_started")


def add_run_window_index(apps, schema_editor):
    TaskRun = apps.get_model("scheduling", "TaskRun")
    with schema_editor.connection.cursor() as cursor:
        existing = schema_editor.connection.introspection.get_constraints(cursor, TaskRun._meta.db_table)
    if RUN_WINDOW.name not in existing:
        schema_editor.add_index(TaskRun, RUN_WINDOW)


def remove_run_window_index(apps, schema_editor):
    schema_editor.remove_index(apps.get_model("scheduling", "TaskRun"), RUN_WINDOW)


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0010_budget_weight_and_rate'),
        ('scheduling', '0013_outcome_slot_lost'),
    ]

    operations = [
        # The triggers go before Backlog changes and come back after it, written with the new column.
        migrations.RunPython(triggers.drop, BEFORE.create),
        migrations.AddField(
            model_name='backlog',
            name='rate_limited',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AlterField(
            model_name='deferredtask',
            name='reason',
            field=models.CharField(choices=[('budget_exhausted', 'Daily CPU budget exhausted'), ('concurrency_cap', 'Account at its concurrency cap'), ('budget_reserved', 'Remaining budget reserved by running jobs'), ('retry_backoff', 'Waiting to retry'), ('scheduled', 'Scheduled for later'), ('queued_behind', "Queued behind the account's held work"), ('paused', 'Paused by an operator'), ('message_lost', 'Its message was lost: to be sent again'), ('needs_newer_worker', 'Needs a newer worker'), ('rate_limited', 'Account at its rate limit')], max_length=30),
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.AddIndex(model_name="taskrun", index=RUN_WINDOW)],
            database_operations=[migrations.RunPython(add_run_window_index, remove_run_window_index)],
        ),
        migrations.RunPython(AFTER.create, triggers.drop),
    ]
