"""The holding area's reason "waiting for a free worker" (new work held in its account's line while
every worker is busy) and its count in Backlog, with the triggers that keep Backlog's counts
rewritten with it."""
from django.db import migrations, models

from scheduling import triggers

BEFORE = triggers.Triggers(("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
                            "queued_behind", "paused", "message_lost", "needs_newer_worker", "rate_limited"))
AFTER = triggers.Triggers((*BEFORE.reasons, "workers_busy"))


# As in 0014: the triggers go before Backlog changes and come back after it, with the new column.
def drop_triggers(apps, schema_editor):
    triggers.drop(schema_editor)


def create_triggers_before(apps, schema_editor):
    BEFORE.create(schema_editor)


def create_triggers_after(apps, schema_editor):
    AFTER.create(schema_editor)


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0016_backlog_held_up'),
    ]

    operations = [
        migrations.RunPython(drop_triggers, create_triggers_before),
        migrations.AddField(
            model_name='backlog',
            name='workers_busy',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AlterField(
            model_name='deferredtask',
            name='reason',
            field=models.CharField(choices=[('budget_exhausted', 'Daily CPU budget exhausted'), ('concurrency_cap', 'Account at its concurrency cap'), ('budget_reserved', 'Remaining budget reserved by running jobs'), ('retry_backoff', 'Waiting to retry'), ('scheduled', 'Scheduled for later'), ('queued_behind', "Queued behind the account's held work"), ('paused', 'Paused by an operator'), ('message_lost', 'Its message was lost: to be sent again'), ('needs_newer_worker', 'Needs a newer worker'), ('rate_limited', 'Account at its rate limit'), ('workers_busy', 'Waiting for a free worker')], max_length=30),
        ),
        migrations.RunPython(create_triggers_after, drop_triggers),
    ]
