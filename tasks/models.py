import uuid

from django.db import models
from django.db.models import Q

from tasks.compat import TaskResultStatus

# The framework's bounds of a priority (the same in django.tasks and django_tasks).
MIN_PRIORITY, MAX_PRIORITY = -100, 100
UNFINISHED = (TaskResultStatus.READY, TaskResultStatus.RUNNING)
FINISHED = (TaskResultStatus.SUCCESSFUL, TaskResultStatus.FAILED)


class TaskCall(models.Model):
    """One call of a Django task (`@task` function, `.enqueue(...)`): what runs, with which
    arguments, for which account, and how it went. The broker's message is the kernel's envelope,
    naming the call by its id (the envelope's ref) and nothing else; a worker loads the rest here.

    Status is the framework's, one to one: READY (waiting: in the broker or in the holding area,
    see `scheduling.DeferredTask` for why), RUNNING, SUCCESSFUL, FAILED. Every transition is one
    guarded UPDATE in tasks/calls.py.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False, verbose_name="call id")
    backend = models.CharField(max_length=32, help_text="The TASKS alias it was enqueued through")
    task_path = models.CharField(max_length=255, verbose_name="task", help_text="Module path of the @task function")
    # Null: a system task (FAIRSHARE's account-less work). No index of its own: taskcall_account_enqueued starts with it.
    account = models.ForeignKey("budgets.Account", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="task_calls", db_index=False)
    queue = models.CharField(max_length=40)
    priority = models.SmallIntegerField(default=0,
        help_text="-100 to 100: the account's higher-priority work goes first")
    run_after = models.DateTimeField(null=True, blank=True, verbose_name="run after",
        help_text="Not started before this time")
    arguments = models.JSONField(help_text='{"args": [...], "kwargs": {...}}, as the function receives them')

    status = models.CharField(max_length=10, choices=TaskResultStatus.choices, default=TaskResultStatus.READY)
    return_value = models.JSONField(null=True, blank=True)
    errors = models.JSONField(default=list, blank=True,
                              help_text="One per failed attempt: exception class path and traceback, redacted")
    # Text, one id a line, not JSON: a claim appends its worker with `||`, in one portable statement.
    workers = models.TextField(blank=True, default="", help_text="host:pid of each worker that started it, one a line")
    # Attempts counted against the limit: a run stopped at the daily CPU cap gives its attempt back.
    attempt_count = models.PositiveSmallIntegerField(default=0, verbose_name="attempts", help_text="Tries so far")
    attempt_limit = models.PositiveSmallIntegerField(default=5, verbose_name="attempt limit",
        help_text="After this many failed tries the call fails for good")
    # The kernel's record of the run that claimed it last; it also fences that run's writes (a run
    # writes only while the call is still its own). No constraint and no cascade: the kernel prunes
    # old task runs and must not wait for this table; a run gone reads as a run that ended.
    run = models.ForeignKey("scheduling.TaskRun", null=True, blank=True, on_delete=models.DO_NOTHING,
                            db_constraint=False, db_index=False, related_name="+")

    enqueued_at = models.DateTimeField(verbose_name="enqueued")
    sent_at = models.DateTimeField(verbose_name="sent", help_text="When its message was last sent (or it was held)")
    started_at = models.DateTimeField(null=True, blank=True, verbose_name="started")
    last_attempted_at = models.DateTimeField(null=True, blank=True, verbose_name="last attempted")
    finished_at = models.DateTimeField(null=True, blank=True, verbose_name="finished")

    class Meta:
        ordering = ["-enqueued_at"]
        verbose_name = "task call"
        constraints = [
            models.CheckConstraint(condition=Q(priority__gte=MIN_PRIORITY, priority__lte=MAX_PRIORITY),
                                   name="taskcall_priority_range"),
        ]
        indexes = [
            # An account's calls, newest first (the admin, a tenant's view).
            models.Index(fields=["account", "-enqueued_at"], name="taskcall_account_enqueued"),
            # What the reconciler reads: the calls still waiting or running, by when they were sent.
            models.Index(fields=["status", "sent_at"], condition=Q(status__in=UNFINISHED), name="taskcall_unfinished"),
            # What maintenance prunes, by age.
            models.Index(fields=["finished_at"], condition=Q(finished_at__isnull=False), name="taskcall_finished"),
        ]

    def __str__(self) -> str:
        return f"{self.task_path.rsplit('.', 1)[-1]} {self.pk} ({self.status})"

    @property
    def worker_ids(self) -> list[str]:
        return self.workers.splitlines()


class DoorMessage(models.Model):
    """A message another service gave Fairshare through the door (tasks/door.py), by its id: the id
    is the idempotency key, so a redelivered message finds its call here and creates nothing new."""

    message_id = models.CharField(max_length=100, unique=True)
    call = models.ForeignKey(TaskCall, null=True, on_delete=models.SET_NULL, related_name="+", db_constraint=False)
    account = models.ForeignKey("budgets.Account", on_delete=models.CASCADE, related_name="+")
    received_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.message_id
