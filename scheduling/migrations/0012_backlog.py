"""The held work counted per account and queue (scheduling.models.Backlog), and each held job's
place in its account's line (DeferredTask.in_line_since).

Backlog's counts are kept by triggers on scheduling_deferredtask, in the statement that changes
it (scheduling.migrations._triggers, written for the reasons this migration knows). Rows held before this
migration join their account's line unless they wait for a time of their own that has not come;
an account whose held work waited for its next budget day has its line held up until then.
"""
import datetime
import django.db.models.deletion
from django.db import migrations, models

from scheduling.migrations import _triggers as triggers


NOT_BLOCKED = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
OWN_TIME_REASONS = ("retry_backoff", "scheduled", "paused")
# Backlog's count columns: one per DeferReason as this migration knows them.
REASONS = ("budget_exhausted", "concurrency_cap", "budget_reserved", "retry_backoff", "scheduled",
           "queued_behind", "paused", "message_lost", "needs_newer_worker")
COUNTS = ("held", "in_line", *REASONS)
TRIGGERS = triggers.Triggers(REASONS)


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
        migrations.RunPython(TRIGGERS.create, triggers.drop),
    ]
