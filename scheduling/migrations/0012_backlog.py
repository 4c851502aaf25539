"""The held work counted per account and queue (scheduling.models.Backlog), and each held job's
place in its account's line (DeferredTask.in_line_since).

Backlog's counts are kept by triggers on scheduling_deferredtask, in the statement that changes
it. On PostgreSQL: per statement for inserts and deletes (transition tables: a bulk hold of
thousands of one account's jobs updates its Backlog row once, not once per job, which within one
transaction would leave a version of that row per job), and per changed row for a change of a
row's account, queue, place in line or reason (a claim, which changes none of these, fires
nothing). On SQLite, the demo's database: row triggers of its own. Rows held before this
migration join their account's line unless they wait for a time of their own that has not come;
an account whose held work waited for its next budget day has its line held up until then.
"""
import datetime
import django.db.models.deletion
from django.db import migrations, models


NOT_BLOCKED = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
OWN_TIME_REASONS = ("retry_backoff", "scheduled", "paused")
# Backlog's count columns: one per DeferReason as this migration knows them.
REASONS = ("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
           "queued_behind", "paused", "message_lost", "needs_newer_worker")
COUNTS = ("held", "in_line", *REASONS)


# Each count of a set of held rows, in COUNTS' order (PostgreSQL aggregates).
COUNTED = ("count(*)", "count(in_line_since)", *(f"count(*) FILTER (WHERE reason = '{r}')" for r in REASONS))


def _row_counts(row: str) -> str:
    """Each count of one row (`OLD`, `NEW`), in COUNTS' order, as 0 or 1 (PostgreSQL and SQLite)."""
    return ", ".join(["1", f"(CASE WHEN {row}.in_line_since IS NULL THEN 0 ELSE 1 END)",
                      *(f"(CASE WHEN {row}.reason = '{reason}' THEN 1 ELSE 0 END)" for reason in REASONS)])


def _upsert(counts_sql: str) -> str:
    """Add counts, given as a SELECT of (account_id, queue, *COUNTS, blocked_until), to Backlog."""
    columns = ", ".join(COUNTS)
    updates = ", ".join(f"{c} = scheduling_backlog.{c} + EXCLUDED.{c}" for c in COUNTS)
    return (f"INSERT INTO scheduling_backlog (account_id, queue, {columns}, blocked_until) {counts_sql} "
            f"ON CONFLICT (account_id, queue) DO UPDATE SET {updates}")


def _take(values: str, *, where: str) -> str:
    """Take counts (`values`: expressions in COUNTS' order) from the Backlog row `where` names."""
    return ("UPDATE scheduling_backlog SET "
            + ", ".join(f"{c} = {c} - {v}" for c, v in zip(COUNTS, values.split(", "))) + f" WHERE {where}")


# The rows a statement inserted, counted per account and queue (in that order: every statement
# locks its Backlog rows in one order, so two of them never wait for each other).
_ADDED = (f"SELECT account_id, queue, {', '.join(COUNTED)}, TIMESTAMPTZ '1970-01-01 00:00:00+00' FROM added "
          "WHERE account_id IS NOT NULL GROUP BY account_id, queue ORDER BY account_id, queue")
POSTGRESQL_TRIGGERS = f"""
CREATE FUNCTION scheduling_backlog_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  {_upsert(_ADDED)};
  RETURN NULL;
END $$;
CREATE FUNCTION scheduling_backlog_take() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE scheduling_backlog k SET {", ".join(f"{c} = k.{c} - d.{c}" for c in COUNTS)}
    FROM (SELECT account_id, queue, {", ".join(f"{agg} AS {c}" for agg, c in zip(COUNTED, COUNTS))}
            FROM taken WHERE account_id IS NOT NULL GROUP BY account_id, queue) d
   WHERE k.account_id = d.account_id AND k.queue = d.queue;
  RETURN NULL;
END $$;
CREATE FUNCTION scheduling_backlog_recount() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.account_id IS NOT NULL THEN
    {_take(_row_counts("OLD"), where="account_id = OLD.account_id AND queue = OLD.queue")};
  END IF;
  IF NEW.account_id IS NOT NULL THEN
    {_upsert(f"VALUES (NEW.account_id, NEW.queue, {_row_counts('NEW')}, TIMESTAMPTZ '1970-01-01 00:00:00+00')")};
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER scheduling_backlog_add AFTER INSERT ON scheduling_deferredtask
  REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION scheduling_backlog_add();
CREATE TRIGGER scheduling_backlog_take AFTER DELETE ON scheduling_deferredtask
  REFERENCING OLD TABLE AS taken FOR EACH STATEMENT EXECUTE FUNCTION scheduling_backlog_take();
CREATE TRIGGER scheduling_backlog_recount AFTER UPDATE OF account_id, queue, in_line_since, reason
  ON scheduling_deferredtask FOR EACH ROW
  WHEN (OLD.account_id IS DISTINCT FROM NEW.account_id OR OLD.queue IS DISTINCT FROM NEW.queue
        OR (OLD.in_line_since IS NULL) <> (NEW.in_line_since IS NULL) OR OLD.reason IS DISTINCT FROM NEW.reason)
  EXECUTE FUNCTION scheduling_backlog_recount();
"""
POSTGRESQL_DROP = """
DROP TRIGGER scheduling_backlog_recount ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_take ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_add ON scheduling_deferredtask;
DROP FUNCTION scheduling_backlog_recount();
DROP FUNCTION scheduling_backlog_take();
DROP FUNCTION scheduling_backlog_add();
"""
_CHANGED = ("OLD.account_id IS NOT NEW.account_id OR OLD.queue IS NOT NEW.queue "
            "OR (OLD.in_line_since IS NULL) <> (NEW.in_line_since IS NULL) OR OLD.reason IS NOT NEW.reason")
_SQLITE_ADD = _upsert(f"SELECT NEW.account_id, NEW.queue, {_row_counts('NEW')}, '1970-01-01 00:00:00' WHERE TRUE")
_SQLITE_TAKE = _take(_row_counts("OLD"), where="account_id = OLD.account_id AND queue = OLD.queue")
SQLITE_TRIGGERS = [
    f"CREATE TRIGGER scheduling_backlog_insert AFTER INSERT ON scheduling_deferredtask "
    f"WHEN NEW.account_id IS NOT NULL BEGIN {_SQLITE_ADD}; END",
    f"CREATE TRIGGER scheduling_backlog_delete AFTER DELETE ON scheduling_deferredtask "
    f"WHEN OLD.account_id IS NOT NULL BEGIN {_SQLITE_TAKE}; END",
    # One trigger per side of a change (SQLite runs a trigger's statements under one WHEN).
    f"CREATE TRIGGER scheduling_backlog_update_old AFTER UPDATE OF account_id, queue, in_line_since, reason "
    f"ON scheduling_deferredtask WHEN OLD.account_id IS NOT NULL AND ({_CHANGED}) BEGIN {_SQLITE_TAKE}; END",
    f"CREATE TRIGGER scheduling_backlog_update_new AFTER UPDATE OF account_id, queue, in_line_since, reason "
    f"ON scheduling_deferredtask WHEN NEW.account_id IS NOT NULL AND ({_CHANGED}) BEGIN {_SQLITE_ADD}; END",
]
SQLITE_DROP = [f"DROP TRIGGER scheduling_backlog_{name}" for name in ("insert", "delete", "update_old", "update_new")]


def line_up_and_count(apps, schema_editor):
    """Existing held work joins its account's line (unless it waits for a time of its own that has
    not come), and each account's held work is counted, before the triggers keep the counts."""
    from django.db.models import Count, Max, Q
    from django.utils import timezone

    DeferredTask = apps.get_model("scheduling", "DeferredTask")
    Backlog = apps.get_model("scheduling", "Backlog")
    now = timezone.now()
    waits_for_itself = Q(reason__in=OWN_TIME_REASONS, eligible_at__gt=now) | Q(message__isnull=False)
    DeferredTask.objects.exclude(waits_for_itself).update(in_line_since=models.F("created_at"))
    counts = (DeferredTask.objects.filter(account__isnull=False).values("account_id", "queue")
              .annotate(held=Count("pk"), in_line=Count("pk", filter=Q(in_line_since__isnull=False)),
                        until=Max("eligible_at", filter=Q(reason="budget_exhausted", eligible_at__gt=now)),
                        **{reason: Count("pk", filter=Q(reason=reason)) for reason in REASONS}))
    Backlog.objects.bulk_create([
        Backlog(account_id=row["account_id"], queue=row["queue"], blocked_until=row["until"] or NOT_BLOCKED,
                **{count: row[count] for count in COUNTS}) for row in counts])


def create_triggers(apps, schema_editor):
    _run(schema_editor, POSTGRESQL_TRIGGERS, SQLITE_TRIGGERS)


def drop_triggers(apps, schema_editor):
    _run(schema_editor, POSTGRESQL_DROP, SQLITE_DROP)


def _run(schema_editor, postgresql: str, sqlite: list[str]) -> None:
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(postgresql)
    elif vendor == "sqlite":
        for statement in sqlite:
            schema_editor.execute(statement)
    else:
        raise NotImplementedError(f"scheduling.Backlog needs triggers written for {vendor}")


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0009_reservation_age_and_lease'),
        ('scheduling', '0011_workerheartbeat_stalled_since'),
    ]

    operations = [
        migrations.CreateModel(
            name='Backlog',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('queue', models.CharField(max_length=40)),
                ('held', models.PositiveIntegerField(default=0)),
                ('in_line', models.PositiveIntegerField(default=0)),
                ('blocked_until', models.DateTimeField(default=datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc))),
                ('budget_exhausted', models.PositiveIntegerField(default=0)),
                ('concurrency_cap', models.PositiveIntegerField(default=0)),
                ('budget_reserved', models.PositiveIntegerField(default=0)),
                ('retry_backoff', models.PositiveIntegerField(default=0)),
                ('scheduled', models.PositiveIntegerField(default=0)),
                ('queued_behind', models.PositiveIntegerField(default=0)),
                ('paused', models.PositiveIntegerField(default=0)),
                ('message_lost', models.PositiveIntegerField(default=0)),
                ('needs_newer_worker', models.PositiveIntegerField(default=0)),
            ],
        ),
        migrations.RemoveIndex(
            model_name='deferredtask',
            name='deferred_claim_order',
        ),
        migrations.AddField(
            model_name='deferredtask',
            name='in_line_since',
            field=models.DateTimeField(blank=True, help_text="Its place in its account's line; empty while it waits for its own time (back-off, run_after, resume)", null=True),
        ),
        migrations.AlterField(
            model_name='deferredtask',
            name='claim_expires_at',
            field=models.DateTimeField(blank=True, help_text='Claimable again after this', null=True),
        ),
        migrations.AddIndex(
            model_name='deferredtask',
            index=models.Index(condition=models.Q(('in_line_since__isnull', False)), fields=['account', 'queue', '-priority', 'in_line_since', 'id'], name='deferred_line'),
        ),
        migrations.AddIndex(
            model_name='deferredtask',
            index=models.Index(condition=models.Q(('in_line_since__isnull', True), ('message__isnull', True)), fields=['eligible_at'], name='deferred_own_time'),
        ),
        migrations.AddIndex(
            model_name='deferredtask',
            index=models.Index(condition=models.Q(('message__isnull', False)), fields=['envelope_version'], name='deferred_parked'),
        ),
        migrations.AddIndex(
            model_name='deferredtask',
            index=models.Index(condition=models.Q(('reason', 'budget_reserved')), fields=['account', 'queue'], name='deferred_budget_reserved'),
        ),
        migrations.AddField(
            model_name='backlog',
            name='account',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='+', to='budgets.account'),
        ),
        migrations.AddIndex(
            model_name='backlog',
            index=models.Index(condition=models.Q(('in_line__gt', 0)), fields=['queue', 'blocked_until'], name='backlog_ready'),
        ),
        migrations.AddConstraint(
            model_name='backlog',
            constraint=models.UniqueConstraint(fields=('account', 'queue'), name='backlog_unique_account_queue'),
        ),
        migrations.RunPython(line_up_and_count, migrations.RunPython.noop),
        migrations.RunPython(create_triggers, drop_triggers),
    ]
