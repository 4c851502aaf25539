from django.db import migrations, models


class Migration(migrations.Migration):
    """An index only (CREATE INDEX on every database): no change of a DeferredTask column, which
    SQLite makes by rebuilding the table, dropping Backlog's triggers (0012_backlog)."""

    dependencies = [
        ('scheduling', '0014_rate_limited'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='deferredtask',
            index=models.Index(fields=['account', 'queue', 'created_at'], name='deferred_account_age'),
        ),
    ]
