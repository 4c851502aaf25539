"""The holding area's reason "waiting for a free worker" (new work held in its account's line while
every worker is busy) and its count in Backlog, with the triggers that keep Backlog's counts
rewritten with it."""
from django.db import migrations, models

from scheduling.migrations import _triggers as triggers

BEFORE = triggers.Triggers(("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
                            "queued_behind", "paused", "message_lost", "needs_newer_worker", "rate_limited"))
AFTER = triggers.Triggers((*BEFORE.reasons, "workers_busy"))


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0016_backlog_held_up'),
    ]

    operations = triggers.rewritten(
        BEFORE, AFTER,
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
    )
