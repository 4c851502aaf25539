"""The outbox: usage events written by database triggers in the transaction of their effect, and
deleted by the relay once the stream acknowledged them (docs/usage-log.md)."""
from django.db import models


class UsageEvent(models.Model):
    """One usage event not yet acknowledged by the stream. Written only by the triggers this app's
    migrations install (usage/migrations/0001_initial.py), so it commits or rolls back with the
    settlement, reclaim or export it describes."""

    # The relay's order: ids are taken at insert, so two transactions may commit out of id order;
    # the relay reads what has committed, by id (docs/usage-log.md "Order").
    id = models.BigAutoField(primary_key=True)
    event_id = models.UUIDField(help_text="The event's id, the stream's Nats-Msg-Id")
    subject = models.CharField(max_length=200)
    body = models.JSONField(help_text="The event (docs/usage-log.md): identifiers and figures, no customer data")
    created_at = models.DateTimeField(help_text="When its transaction wrote it")

    def __str__(self) -> str:
        return f"{self.subject} {self.event_id}"
