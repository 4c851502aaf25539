"""Backlog.lined (`in_line > 0`, a stored generated column) and backlog_ready partial on it instead of
on `in_line`: the triggers' update of an account's Backlog row, made for every job held or let go,
then changes no column an index names (but when a line starts or empties), so it stays on the
row's page (HOT) and writes no index entry. Backlog holds a row per account and queue: rewriting it
and its index takes no time worth a concurrent build. The triggers go before the column and come
back after it (SQLite rebuilds the table to add a stored column)."""
from django.db import migrations, models

from scheduling.migrations import _triggers as triggers

REASONS = triggers.Triggers(("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
                             "queued_behind", "paused", "message_lost", "needs_newer_worker", "rate_limited",
                             "workers_busy"))


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0010_budget_weight_and_rate'),
        ('scheduling', '0018_taskrun_indexes'),
    ]

    operations = triggers.rewritten(
        REASONS, REASONS,
        migrations.RemoveIndex(
            model_name='backlog',
            name='backlog_ready',
        ),
        migrations.AddField(
            model_name='backlog',
            name='lined',
            field=models.GeneratedField(db_persist=True, expression=models.Q(('in_line__gt', 0)),
                                        output_field=models.BooleanField()),
        ),
        migrations.AddIndex(
            model_name='backlog',
            index=models.Index(condition=models.Q(('lined', True)), fields=['queue', 'blocked_until'],
                               name='backlog_ready'),
        ),
    )
