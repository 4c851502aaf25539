"""The outbox: usage events written in the transaction of their effect, and deleted by the relay
once the stream acknowledged them (docs/usage-log.md)."""
from django.contrib.postgres.functions import RandomUUID
from django.db import models
from django.db.models.functions import Now


class UsageEvent(models.Model):
    """One usage event not yet acknowledged by the stream, written with its effect so that it commits
    or rolls back with it: a run's by the ledger's settlement statement (budgets/ledger/queries.sql
    `settle`) and by the reclaim's and revival's triggers, an export's by a trigger
    (usage/migrations). A run's event is kept as its figures, rendered as JSON by the relay in
    batches (usage/queries.sql `oldest`: the format's one place); an export's as its `body`."""

    # The relay's order: ids are taken at insert, so two transactions may commit out of id order;
    # the relay reads what has committed, by id (docs/usage-log.md "Order").
    id = models.BigAutoField(primary_key=True)
    event_id = models.UUIDField(db_default=RandomUUID(), help_text="The event's id, the stream's Nats-Msg-Id")
    subject = models.CharField(max_length=200, null=True, help_text="An export's; a run's is rendered")
    body = models.JSONField(null=True, help_text="An export's event as published (docs/usage-log.md); "
                                                 "a run's is rendered from the fields below")
    created_at = models.DateTimeField(db_default=Now(), help_text="When its transaction wrote it (a run's `at`)")
    # A run's event, as docs/usage-log.md "The event format" names its fields.
    kind = models.CharField(max_length=10, blank=True, db_default="",
                            help_text="A run's: settled, lost (reclaimed: also run.settled) or revived")
    account_id = models.BigIntegerField(null=True)
    queue = models.CharField(max_length=40, blank=True, db_default="")
    day = models.DateField(null=True)
    run_id = models.BigIntegerField(null=True)
    job = models.CharField(max_length=100, blank=True, db_default="")
    ref = models.CharField(max_length=64, blank=True, db_default="")
    outcome = models.CharField(max_length=20, null=True)
    started_at = models.DateTimeField(null=True)
    finished_at = models.DateTimeField(null=True)
    cpu_ms = models.BigIntegerField(null=True)
    wall_ms = models.BigIntegerField(null=True)
    db_wait_ms = models.BigIntegerField(null=True)
    storage_wait_ms = models.BigIntegerField(null=True)
    items = models.BigIntegerField(null=True)
    # What it charged the day: its runs and CPU (its wall time and waits too when settled).
    charged_runs = models.IntegerField(null=True)
    charged_cpu_ms = models.BigIntegerField(null=True)

    def __str__(self) -> str:
        return f"{self.subject} {self.event_id}"
