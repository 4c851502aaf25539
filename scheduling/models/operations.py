"""The records of the processes and of the operators' decisions: the workers' heartbeats, pauses and
the dead letters (scheduling.models holds the runs and the holding area)."""
from django.conf import settings
from django.db import models


class WorkerHeartbeat(models.Model):
    """Each worker process says it is alive every few seconds (read by /healthz and /metrics)."""

    worker = models.CharField(max_length=100, unique=True, help_text="host:pid")
    queue = models.CharField(max_length=40)
    seen_at = models.DateTimeField()
    stalled_since = models.DateTimeField(
        null=True, blank=True,
        help_text="Since when this idle worker has seen work wait in its pool that no worker takes (scheduling.stuck)")

    class Meta:
        # The enqueue check's question, every enqueue: how many workers of the queue run now (their
        # heartbeats since scheduling.liveness.heard_since)? The rows of workers gone (a recycled
        # worker process is a new one) stay until the prune, days later: read none of them.
        indexes = [models.Index(fields=["queue", "seen_at"], name="heartbeat_live")]

    def __str__(self) -> str:
        return f"{self.worker} ({self.queue})"


class Pause(models.Model):
    """An operator's pause (scheduling.pausing): of one account (on every queue, `queue` empty),
    or of a whole queue (every account's work, `account` empty). Its work waits in the holding
    area with reason "paused" until the pause is lifted."""

    account = models.ForeignKey("budgets.Account", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    queue = models.CharField(max_length=40, blank=True)
    paused_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["account", "queue"], nulls_distinct=False, name="pause_unique_account_queue"),
            models.CheckConstraint(condition=~models.Q(account__isnull=True, queue=""), name="pause_names_something"),
        ]

    def __str__(self) -> str:
        if self.account_id is None:
            return f"queue {self.queue}"
        return f"account {self.account}" + (f" on {self.queue}" if self.queue else "")


class DeadLetter(models.Model):
    """A RabbitMQ message nobody can honour (scheduling.dead_letters): its reason, for an operator.
    The message itself waits in its queue's dead-letter queue (scheduling.amqp)."""

    key = models.CharField(max_length=200, unique=True, help_text="queue and message id (or body digest)")
    queue = models.CharField(max_length=200)
    reason = models.TextField()
    message_id = models.CharField(max_length=200, blank=True)
    account = models.ForeignKey("budgets.Account", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    body = models.TextField(blank=True, help_text="the start of the body, redacted")
    body_bytes = models.PositiveIntegerField(default=0)
    deliveries = models.PositiveIntegerField(default=1)
    first_seen_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.queue}: {self.reason[:60]}"
