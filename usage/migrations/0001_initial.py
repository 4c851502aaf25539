"""The outbox table and the triggers that write usage events into it (docs/usage-log.md).

Events are written by PostgreSQL, in the statement and transaction of their effect, so an event
exists exactly when its effect does: a settlement, a reclaim or an export's end that rolls back
takes its event with it, and no code path can forget one. Every trigger does nothing unless the
session's `fairshare_usage.events` is '1' (config/settings.py sets it on the connections of a process
with FAIRSHARE_USAGE_NATS_URL), so with the usage log off a settlement pays one comparison.

A run's usage is written where the ledger charges it, on the slot (budgets_reservation; installed
from here, this app's own migration, so the ledger's app knows nothing of it):

- the slot deleted by a settlement (budgets.ledger.settling: one statement deletes the slot and
  records its run's end): `run.settled`, charged as the settlement charges the day: the run counted
  if its slot was active, its CPU less what a reclaim charged already, its wall time and waits.
  A slot is also deleted where nothing is charged (an admission undone, a reclaimed slot forgotten
  after a day): those statements do not record a run's end, and the mark below tells them apart;
- the slot reclaimed (active -> reclaimed: its worker died): `run.settled` with outcome `lost`,
  charged the run and the CPU the reclaim charged;
- the slot revived (reclaimed -> active: its worker was only frozen): `run.revived`, which takes
  back the run the reclaim counted (its settlement counts it again).

The mark: a BEFORE trigger on scheduling_taskrun notes in a transaction-local setting which run
ended in which statement (`<run id>@<statement_timestamp()>`); the slot's AFTER DELETE trigger, at
the end of the same statement, emits only when its run ended in that statement.
"""
from django.db import migrations, models

ON = "current_setting('fairshare_usage.events', true) = '1'"

FUNCTIONS = f"""
CREATE FUNCTION usage_run_event(p_type text, p_slot budgets_reservation, p_mode text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
  t scheduling_taskrun%ROWTYPE;
  ev uuid := gen_random_uuid();
  settled boolean := p_mode = 'settled';
  c_runs integer;
  c_cpu bigint;
BEGIN
  -- The run by primary key: one index probe.
  SELECT * INTO t FROM scheduling_taskrun WHERE id = p_slot.task_run_id;
  IF p_mode = 'settled' THEN
    c_runs := CASE WHEN p_slot.status = 'active' THEN 1 ELSE 0 END;
    c_cpu := GREATEST(COALESCE(t.cpu_ms, 0) - p_slot.cpu_charged_ms, 0);
  ELSIF p_mode = 'lost' THEN
    c_runs := 1;
    c_cpu := p_slot.cpu_charged_ms;
  ELSE  -- revived
    c_runs := -1;
    c_cpu := 0;
  END IF;
  INSERT INTO usage_usageevent (event_id, subject, body, created_at)
  VALUES (ev, 'run.' || p_slot.queue || '.' || p_slot.account_id, jsonb_build_object(
    'v', 1, 'id', ev, 'type', p_type, 'at', clock_timestamp(),
    'account', p_slot.account_id, 'queue', p_slot.queue, 'day', p_slot.day,
    'run', t.id, 'job', t.job, 'ref', t.ref,
    'outcome', CASE WHEN p_mode = 'lost' THEN COALESCE(NULLIF(t.outcome, 'running'), 'lost')
                    WHEN p_mode = 'revived' THEN 'running' ELSE NULLIF(t.outcome, 'running') END,
    'started_at', t.started_at, 'finished_at', CASE WHEN p_mode = 'revived' THEN NULL ELSE t.finished_at END,
    'cpu_ms', CASE WHEN p_mode = 'lost' THEN GREATEST(COALESCE(t.cpu_ms, 0), p_slot.cpu_charged_ms) ELSE t.cpu_ms END,
    'wall_ms', t.wall_ms, 'db_wait_ms', t.db_wait_ms, 'storage_wait_ms', t.storage_wait_ms, 'items', t.items,
    'charged', jsonb_build_object(
      'runs', c_runs, 'cpu_ms', c_cpu,
      'wall_ms', CASE WHEN settled THEN COALESCE(t.wall_ms, 0) ELSE 0 END,
      'db_wait_ms', CASE WHEN settled THEN COALESCE(t.db_wait_ms, 0) ELSE 0 END,
      'storage_wait_ms', CASE WHEN settled THEN COALESCE(t.storage_wait_ms, 0) ELSE 0 END)
  ), now());
END $$;

CREATE FUNCTION usage_mark_run_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('fairshare_usage.run_ended', NEW.id::text || '@' || statement_timestamp()::text, true);
  RETURN NEW;
END $$;

CREATE FUNCTION usage_slot_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('fairshare_usage.run_ended', true) = OLD.task_run_id::text || '@' || statement_timestamp()::text
  THEN
    PERFORM usage_run_event('run.settled', OLD, 'settled');
  END IF;
  RETURN NULL;
END $$;

CREATE FUNCTION usage_slot_status() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.status = 'active' AND NEW.status = 'reclaimed' THEN
    PERFORM usage_run_event('run.settled', NEW, 'lost');
  ELSIF OLD.status = 'reclaimed' AND NEW.status = 'active' THEN
    PERFORM usage_run_event('run.revived', NEW, 'revived');
  END IF;
  RETURN NULL;
END $$;

CREATE FUNCTION usage_export_finished() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
  ev uuid := gen_random_uuid();
BEGIN
  INSERT INTO usage_usageevent (event_id, subject, body, created_at)
  VALUES (ev, 'export.' || NEW.account_id, jsonb_build_object(
    'v', 1, 'id', ev, 'type', 'export.finished', 'at', clock_timestamp(), 'account', NEW.account_id,
    'export', NEW.id, 'status', NEW.status, 'format', NEW.format, 'source', NEW.source,
    'rows', NEW.row_count, 'bytes', NEW.byte_size, 'attempts', NEW.attempt_count,
    'requested_at', NEW.created_at, 'started_at', NEW.started_at, 'completed_at', NEW.completed_at
  ), now());
  RETURN NULL;
END $$;

CREATE TRIGGER usage_run_end BEFORE UPDATE OF finished_at ON scheduling_taskrun FOR EACH ROW
  WHEN (NEW.finished_at IS NOT NULL AND {ON}) EXECUTE FUNCTION usage_mark_run_end();
CREATE TRIGGER usage_slot_deleted AFTER DELETE ON budgets_reservation FOR EACH ROW
  WHEN (OLD.task_run_id IS NOT NULL AND {ON}) EXECUTE FUNCTION usage_slot_deleted();
CREATE TRIGGER usage_slot_status AFTER UPDATE OF status ON budgets_reservation FOR EACH ROW
  WHEN (OLD.status IS DISTINCT FROM NEW.status AND NEW.task_run_id IS NOT NULL AND {ON})
  EXECUTE FUNCTION usage_slot_status();
CREATE TRIGGER usage_export_finished AFTER UPDATE OF status ON exports_exportrecord FOR EACH ROW
  WHEN (OLD.status IS DISTINCT FROM NEW.status AND NEW.status IN ('succeeded', 'failed') AND {ON})
  EXECUTE FUNCTION usage_export_finished();
"""

DROP = """
DROP TRIGGER IF EXISTS usage_export_finished ON exports_exportrecord;
DROP TRIGGER IF EXISTS usage_slot_status ON budgets_reservation;
DROP TRIGGER IF EXISTS usage_slot_deleted ON budgets_reservation;
DROP TRIGGER IF EXISTS usage_run_end ON scheduling_taskrun;
DROP FUNCTION IF EXISTS usage_export_finished();
DROP FUNCTION IF EXISTS usage_slot_status();
DROP FUNCTION IF EXISTS usage_slot_deleted();
DROP FUNCTION IF EXISTS usage_mark_run_end();
DROP FUNCTION IF EXISTS usage_run_event(text, budgets_reservation, text);
"""


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("budgets", "0011_reservation_carried_charges"),
        ("exports", "0006_human_labels"),
        ("scheduling", "0022_dead_letter"),
    ]

    operations = [
        migrations.CreateModel(
            name="UsageEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("event_id", models.UUIDField(help_text="The event's id, the stream's Nats-Msg-Id")),
                ("subject", models.CharField(max_length=200)),
                ("body", models.JSONField(
                    help_text="The event (docs/usage-log.md): identifiers and figures, no customer data")),
                ("created_at", models.DateTimeField(help_text="When its transaction wrote it")),
            ],
        ),
        migrations.RunSQL(FUNCTIONS, DROP),
    ]
