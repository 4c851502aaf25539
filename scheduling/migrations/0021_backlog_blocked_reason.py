"""Backlog says why a line is held up (`blocked_reason`, beside `blocked_until`), and its per-reason
counts count only the jobs out of their account's line (waiting for a time of their own): a job in
line waits for whatever its line waits for now (scheduling.waits), not for the reason it was held
for, which goes stale. The triggers are rewritten so and the counts recounted from the held rows.
Backlog holds a row per account and queue: the recount reads the holding area once."""
from django.db import migrations, models

from scheduling.migrations import _triggers as triggers

REASONS = ("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled", "queued_behind",
           "paused", "message_lost", "needs_newer_worker", "rate_limited", "workers_busy")
BEFORE, AFTER = triggers.Triggers(REASONS), triggers.Triggers(REASONS, own_time=True)


def _recount(schema_editor, counts: triggers.Triggers) -> None:
    columns = ", ".join(f"{c} = COALESCE(d.{c}, 0)" for c in counts.reasons)
    counted = ", ".join(f"{agg} AS {c}" for agg, c in zip(counts._counted()[2:], counts.reasons))
    schema_editor.execute(
        f"UPDATE scheduling_backlog k SET {columns} FROM scheduling_backlog b LEFT JOIN "
        f"(SELECT account_id, queue, {counted} FROM scheduling_deferredtask WHERE account_id IS NOT NULL "
        "GROUP BY account_id, queue) d ON d.account_id = b.account_id AND d.queue = b.queue WHERE k.id = b.id")


def recount_out_of_line(apps, schema_editor):
    _recount(schema_editor, AFTER)


def recount_all(apps, schema_editor):
    _recount(schema_editor, BEFORE)


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0020_human_labels_holding_area'),
    ]

    operations = triggers.rewritten(
        BEFORE, AFTER,
        migrations.AddField(
            model_name='backlog',
            name='blocked_reason',
            field=models.CharField(blank=True, db_default='', max_length=30),
        ),
        migrations.RunPython(recount_out_of_line, recount_all),
    )
