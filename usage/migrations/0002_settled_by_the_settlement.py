"""A run's event is written as its figures, and the settled one by the settlement's own statement.

- The settled event: budgets/ledger/queries.sql `settle` (its `e`) inserts it in the statement
  that deletes the slot and records the run's end, instead of the slot's AFTER DELETE trigger and
  the run's mark, which cost a settlement's backend several times more (docs/usage-log.md *Costs*).
- A run's event is kept as typed columns, not as JSON built in the writing transaction: the relay
  renders it, a batch at a time (usage/queries.sql `oldest`, the format's one place). Its id and
  time are the columns' defaults. An export's keeps its `body` and `subject`.
- The reclaim's and revival's events (a worker died or froze: rare) stay triggers, writing the
  same columns.
"""
import django.contrib.postgres.functions
import django.db.models.functions.datetime
from django.db import migrations, models

RUN_EVENT = """
-- Whether this session writes events (config/settings.py sets it where FAIRSHARE_USAGE_NATS_URL is):
-- what the settlement's statement asks, inlined by PostgreSQL.
CREATE OR REPLACE FUNCTION usage_events_on() RETURNS boolean LANGUAGE sql STABLE PARALLEL SAFE
  AS $$ SELECT current_setting('fairshare_usage.events', true) = '1' $$;
CREATE OR REPLACE FUNCTION usage_run_event(p_type text, p_slot budgets_reservation, p_mode text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
  -- p_mode 'lost' (a reclaim) or 'revived'; the run by primary key: one index probe.
  INSERT INTO usage_usageevent (kind, account_id, queue, day, charged_runs, charged_cpu_ms, run_id, job, ref,
                                outcome, started_at, finished_at, cpu_ms, wall_ms, db_wait_ms, storage_wait_ms, items)
  SELECT p_mode, p_slot.account_id, p_slot.queue, p_slot.day, CASE WHEN p_mode = 'lost' THEN 1 ELSE -1 END,
         CASE WHEN p_mode = 'lost' THEN p_slot.cpu_charged_ms ELSE 0 END, t.id, t.job, t.ref,
         CASE WHEN p_mode = 'lost' THEN COALESCE(NULLIF(t.outcome, 'running'), 'lost') ELSE 'running' END,
         t.started_at, CASE WHEN p_mode = 'lost' THEN t.finished_at END,
         CASE WHEN p_mode = 'lost' THEN GREATEST(COALESCE(t.cpu_ms, 0), p_slot.cpu_charged_ms) ELSE t.cpu_ms END,
         t.wall_ms, t.db_wait_ms, t.storage_wait_ms, t.items
    FROM scheduling_taskrun t WHERE t.id = p_slot.task_run_id;
END $$;
DROP TRIGGER IF EXISTS usage_slot_deleted ON budgets_reservation;
DROP TRIGGER IF EXISTS usage_run_end ON scheduling_taskrun;
DROP FUNCTION IF EXISTS usage_slot_deleted();
DROP FUNCTION IF EXISTS usage_mark_run_end();
"""
UNDONE = "DROP FUNCTION IF EXISTS usage_events_on();"


def _initial():
    import importlib

    initial = importlib.import_module("usage.migrations.0001_initial")
    return UNDONE + initial.DROP + initial.FUNCTIONS


class Migration(migrations.Migration):

    dependencies = [
        ('usage', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='usageevent',
            name='account_id',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='charged_cpu_ms',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='charged_runs',
            field=models.IntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='cpu_ms',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='day',
            field=models.DateField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='db_wait_ms',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='finished_at',
            field=models.DateTimeField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='items',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='job',
            field=models.CharField(blank=True, db_default='', max_length=100),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='kind',
            field=models.CharField(blank=True, db_default='', help_text="A run's: settled, lost (reclaimed: also run.settled) or revived", max_length=10),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='outcome',
            field=models.CharField(max_length=20, null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='queue',
            field=models.CharField(blank=True, db_default='', max_length=40),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='ref',
            field=models.CharField(blank=True, db_default='', max_length=64),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='run_id',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='started_at',
            field=models.DateTimeField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='storage_wait_ms',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AddField(
            model_name='usageevent',
            name='wall_ms',
            field=models.BigIntegerField(null=True),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='body',
            field=models.JSONField(help_text="An export's event as published (docs/usage-log.md); a run's is rendered from the fields below", null=True),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='created_at',
            field=models.DateTimeField(db_default=django.db.models.functions.datetime.Now(), help_text="When its transaction wrote it (a run's `at`)"),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='event_id',
            field=models.UUIDField(db_default=django.contrib.postgres.functions.RandomUUID(), help_text="The event's id, the stream's Nats-Msg-Id"),
        ),
        migrations.AlterField(
            model_name='usageevent',
            name='subject',
            field=models.CharField(help_text="An export's; a run's is rendered", max_length=200, null=True),
        ),
            migrations.RunSQL(RUN_EVENT, _initial()),
    ]
