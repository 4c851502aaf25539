import datetime as dt

from django.db import models

from scheduling.models.operations import DeadLetter, Pause, WorkerHeartbeat  # noqa: F401 (registered here)


class Outcome(models.TextChoices):
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    # The handler decided there was nothing to do (e.g. the export was already finished or
    # another worker holds its lease): a duplicate delivery, harmless by design.
    SKIPPED = "skipped", "Skipped"
    FAILED = "failed", "Failed"
    # A transient failure: the job waits in the holding area to be tried again (back-off).
    RETRYING = "retrying", "Failed, will retry"
    CANCELLED = "cancelled", "Cancelled"
    # The message itself was unusable (malformed envelope, unknown version or job).
    REJECTED = "rejected", "Rejected (contract)"
    # Admission refused it (budget or concurrency cap): it waits in the holding area.
    DEFERRED = "deferred", "Held (holding area)"
    # Stopped by the daily CPU cap; the job waits for the next budget day.
    BUDGET_EXHAUSTED = "budget_exhausted", "Budget exhausted"
    # The worker died mid-run; found by the reclaim job once its lease expired.
    LOST = "lost", "Lost (worker died)"
    # Its slot was reclaimed while its worker was frozen (a VM pause) and no slot was free when it
    # woke: it stopped at its next budget tick, and its job waits in the holding area again.
    SLOT_LOST = "slot_lost", "Stopped: its slot was reclaimed while its worker was frozen"


class TaskRun(models.Model):
    """One execution of one job, written by the runner's recording middleware."""

    # Its indexes are written with every run (one insert; the end's update, which changes no
    # indexed column, can stay on the row's page with none): only those a read needs. The
    # account's is taskrun_account_started's first column.
    account = models.ForeignKey(
        "budgets.Account", null=True, blank=True, on_delete=models.SET_NULL, related_name="task_runs",
        db_index=False,
    )
    job = models.CharField(max_length=100, help_text="The registered kind of work that ran")
    queue = models.CharField(max_length=40, default="default")
    ref = models.CharField(max_length=64, blank=True, verbose_name="reference",
        help_text="What the job works on (an export's id, a task call's id)")
    worker = models.CharField(max_length=100, blank=True, help_text="host:pid of the worker process that ran it")
    started_at = models.DateTimeField(db_index=True, verbose_name="started")
    finished_at = models.DateTimeField(null=True, blank=True, verbose_name="finished")
    outcome = models.CharField(max_length=20, choices=Outcome.choices, default=Outcome.RUNNING, db_default=Outcome.RUNNING,
        help_text="How the run ended. Budget exhausted: its account's daily CPU budget ran out during the run, "
                  "which stopped cleanly; its job waits in the holding area for the next budget day")
    cpu_ms = models.PositiveIntegerField(default=0, db_default=0, verbose_name="CPU time (ms)",
        help_text="Process CPU time the run used: what its account's daily CPU budget is charged")
    wall_ms = models.PositiveIntegerField(default=0, db_default=0, verbose_name="wall time (ms)",
        help_text="From start to finish, by the clock")
    db_wait_ms = models.PositiveIntegerField(default=0, db_default=0, verbose_name="database wait (ms)",
        help_text="Time spent waiting for the database")
    storage_wait_ms = models.PositiveIntegerField(default=0, db_default=0, verbose_name="storage wait (ms)",
        help_text="Time spent waiting for object storage")
    items = models.PositiveBigIntegerField(default=0, db_default=0, help_text="What the job counted as done (an export's rows)")
    peak_rss_kb = models.PositiveIntegerField(default=0, db_default=0, verbose_name="peak memory (KB)",
        help_text="The worker process's peak resident memory after the run")
    error_class = models.CharField(max_length=200, blank=True, db_default="")
    error_message = models.TextField(blank=True, db_default="", verbose_name="error", help_text="Redacted before it is stored")

    class Meta:
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["account", "started_at"], name="taskrun_account_started"),
            # A rate limit's window (budgets.standing): the account's latest starts on one queue,
            # newest first, read no further than its limit (each entry's row for its outcome).
            models.Index(fields=["account", "queue", "-started_at"], name="taskrun_account_queue_started"),
            # A job's runs (exports', the admin's filter) and a ref's; equality only (the admin's
            # search is a substring's, which no B-tree serves).
            models.Index(fields=["job"], name="taskrun_job"),
            models.Index(fields=["ref"], name="taskrun_ref"),
        ]

    def __str__(self) -> str:
        return f"{self.job} {self.ref} [{self.outcome}]"


class DeferReason(models.TextChoices):
    BUDGET_EXHAUSTED = "budget_exhausted", "Daily CPU budget exhausted"
    CONCURRENCY_CAP = "concurrency_cap", "Account at its concurrency cap"
    # The account has budget left today, but its running jobs have reserved all of it: released
    # when one of them settles (and gives back what it did not use).
    BUDGET_RESERVED = "budget_reserved", "Remaining budget reserved by running jobs"
    RETRY_BACKOFF = "retry_backoff", "Waiting to retry"
    # Enqueued with a time before which it may not run (`enqueue(run_after=)`, Django's `run_after`).
    SCHEDULED = "scheduled", "Scheduled for later"
    QUEUED_BEHIND = "queued_behind", "Queued behind the account's held work"
    # An operator paused the account or the queue (scheduling.pausing); resuming releases it.
    PAUSED = "paused", "Paused by an operator"
    # Released (dispatched) but its message never started within the dispatch lease: sent again.
    MESSAGE_LOST = "message_lost", "Its message was lost: to be sent again"
    # Rolling upgrade: the message's envelope version is newer than the worker that got it speaks.
    # Released only by a worker that speaks it (DeferredTask.envelope_version).
    NEEDS_NEWER_WORKER = "needs_newer_worker", "Needs a newer worker"
    # The account started as many runs on the queue as its rate limit allows in a window: it waits
    # until the oldest of them leaves the window (budgets.standing.Standing.rate_frees_at).
    RATE_LIMITED = "rate_limited", "Account at its rate limit"
    # Every worker of the queue is busy (a job sent to the broker waits for one): new work waits in
    # its account's line, taken in the fair order by the busy workers' loops, instead of in the
    # broker's first-in-first-out (budgets.admission.admit_at_enqueue).
    WORKERS_BUSY = "workers_busy", "Waiting for a free worker"


# A job held for one of these waits for a time of its own (its `eligible_at`) before it joins its
# account's line; for any other reason it joins the line at once and waits for its account.
OWN_TIME_REASONS = frozenset({DeferReason.RETRY_BACKOFF, DeferReason.SCHEDULED, DeferReason.PAUSED})
# A job held for one of these until a later time holds up its account's whole line until then.
ACCOUNT_WAITS_REASONS = frozenset({DeferReason.BUDGET_EXHAUSTED, DeferReason.RATE_LIMITED})
# Recorded runs that never started their handler (admission refused it, or the message was
# unusable): not starts, for a rate limit.
NOT_STARTED = (Outcome.DEFERRED, Outcome.REJECTED)


class DeferredTask(models.Model):
    """The holding area: a job that may not run now, why, and from when it may.

    A held job is not in the broker. It waits either for a time of its own (a retry's back-off,
    a `run_after`, a resume: `in_line_since` is NULL) or, in its account's line (`in_line_since`
    set), for its account: a free slot, budget, the end of a pause. Releasing it deletes the row and
    rings the doorbell again. A worker may instead claim it (hand-off or pull) to run it itself
    without a broker round trip: the row stays, claimed, until that run starts; a claim whose lease
    expired (the worker died) makes the job claimable again. Backlog counts these rows per account
    and queue (kept by database triggers, scheduling/migrations/0012_backlog.py).
    """

    # Null only for account-less work: a parked maintenance message, scheduled system work.
    # Its index stays beside deferred_account_age, which could serve its reads: dropping it is a
    # migration that alters the column, for no measured gain.
    account = models.ForeignKey("budgets.Account", null=True, blank=True, on_delete=models.CASCADE,
                                related_name="deferred_tasks")
    queue = models.CharField(max_length=40)
    job = models.CharField(max_length=100)
    ref = models.CharField(max_length=64, verbose_name="reference",
        help_text="What the job works on (an export's id, a task call's id)")
    reason = models.CharField(max_length=30, choices=DeferReason.choices, verbose_name="reason recorded",
        help_text="Why it was held when it was held (the page shows why it waits now)")
    eligible_at = models.DateTimeField(verbose_name="own time",
        help_text="Not released before this time (back-off, run_after, a pause)")
    created_at = models.DateTimeField(auto_now_add=True, verbose_name="held since")
    in_line_since = models.DateTimeField(
        null=True, blank=True, verbose_name="in its account's line since",
        help_text="Its place in its account's line; empty while it waits for a time of its own (back-off, run_after, a pause)")
    deferrals = models.PositiveIntegerField(default=1, verbose_name="times held",
        help_text="How often this job was held")
    priority = models.SmallIntegerField(default=0,
        help_text="-100 to 100: the account's higher-priority work goes first")
    claimed_by = models.CharField(max_length=100, blank=True, verbose_name="claimed by",
        help_text="host:pid of the worker about to run it")
    claim_expires_at = models.DateTimeField(null=True, blank=True, verbose_name="claim expires",
        help_text="Claimable again after this")
    envelope_version = models.PositiveSmallIntegerField(
        default=1, help_text="Released only by a worker that speaks this envelope version")
    message = models.JSONField(
        null=True, blank=True, editable=False,
        help_text="A parked message exactly as it arrived (identifiers only), sent back unchanged")

    class Meta:
        verbose_name = "held job"
        verbose_name_plural = "holding area"
        ordering = ["created_at", "id"]
        constraints = [
            # Duplicate deliveries of one envelope are held once.
            models.UniqueConstraint(fields=["job", "ref"], name="deferredtask_unique_job_ref")
        ]
        indexes = [
            # An account's line in the order it goes (highest priority, then longest in line): a
            # claim or release reads it in index order and stops at the first unclaimed row.
            models.Index(fields=["account", "queue", "-priority", "in_line_since", "id"], name="deferred_line",
                         condition=models.Q(in_line_since__isnull=False)),
            # What waits for a time of its own, by that time: the pulse lines up what is due.
            models.Index(fields=["eligible_at"], name="deferred_own_time",
                         condition=models.Q(in_line_since__isnull=True, message__isnull=True)),
            # Messages parked for a newer worker, by version: released by one that speaks it.
            models.Index(fields=["envelope_version"], name="deferred_parked", condition=models.Q(message__isnull=False)),
            # An account's held jobs on a queue by age: the fair-share view's "oldest held job" of
            # each line it shows reads one entry, however long the line.
            models.Index(fields=["account", "queue", "created_at"], name="deferred_account_age"),
        ]

    def __str__(self) -> str:
        # Not its reason: the one recorded when it was held may no longer be why it waits (its
        # line's is: scheduling.waits), and a page's title must not say otherwise.
        return f"held {self.job} {self.ref}"


# Backlog.blocked_until of an account whose line is not held up.
NOT_BLOCKED = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class Backlog(models.Model):
    """The holding area counted, per account and queue: how many jobs it holds (`held`), how many of
    them are in the account's line (`in_line`: they go as soon as the account may run, and wait for
    whatever the line waits for now: scheduling.waits), those out of it, waiting for a time of their
    own, by the reason they were held for (one column per DeferReason), and until when and why the
    whole line waits
    (`blocked_until`, `blocked_reason`: the account's budget is spent until the next budget day, or its rate limit
    is reached until the oldest start leaves its window; NOT_BLOCKED once the pulse let it go). What a worker asks
    per task and per tick about held work ("is anything of this account's in line", "which
    accounts could run now"), and what the views show of it, read this table: their cost follows
    the number of accounts, never the number of held jobs.

    The counts are kept by database triggers on DeferredTask, in the statement that changes it
    (migrations 0012_backlog, 0021_backlog_blocked_reason: per statement for inserts and deletes, per changed row for a change
    of account, queue, place in line or reason); `blocked_until` by scheduling.holding (`block`,
    `unblock`). A new DeferReason needs a column here and the triggers rewritten with it
    (scheduling.migrations._triggers; a test checks that every reason has its column).
    """

    account = models.ForeignKey("budgets.Account", on_delete=models.CASCADE, related_name="+")
    queue = models.CharField(max_length=40)
    held = models.PositiveIntegerField(default=0)
    in_line = models.PositiveIntegerField(default=0)
    blocked_until = models.DateTimeField(default=NOT_BLOCKED)
    # Why the line is held up until `blocked_until` (one of ACCOUNT_WAITS_REASONS; meaningless once
    # that time passed): what /metrics says of its jobs without reading each line's standing.
    blocked_reason = models.CharField(max_length=30, blank=True, db_default="")  # the triggers insert without it
    budget_exhausted = models.PositiveIntegerField(default=0)
    concurrency_cap = models.PositiveIntegerField(default=0)
    budget_reserved = models.PositiveIntegerField(default=0)
    retry_backoff = models.PositiveIntegerField(default=0)
    scheduled = models.PositiveIntegerField(default=0)
    queued_behind = models.PositiveIntegerField(default=0)
    paused = models.PositiveIntegerField(default=0)
    message_lost = models.PositiveIntegerField(default=0)
    needs_newer_worker = models.PositiveIntegerField(default=0)
    rate_limited = models.PositiveIntegerField(default=0)
    workers_busy = models.PositiveIntegerField(default=0)
    # Whether anything is in line (`in_line > 0`), kept by the database: what backlog_ready is
    # partial on. The triggers change `in_line` with every job held or let go; an index whose
    # condition named `in_line` would make each of those updates write a new entry in every
    # index of this (hot) row, while one on `lined` lets them stay on the row's page (HOT) but
    # when a line starts or empties.
    lined = models.GeneratedField(expression=models.Q(in_line__gt=0), output_field=models.BooleanField(),
                                  db_persist=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["account", "queue"], name="backlog_unique_account_queue")]
        # Accounts with work in line on a queue, by when they may run: "which could run now" reads
        # the ones not held up and no other; the pulse's let-go only the lines whose time came.
        indexes = [models.Index(fields=["queue", "blocked_until"], name="backlog_ready",
                                condition=models.Q(lined=True)),
                   models.Index(fields=["blocked_until"], name="backlog_held_up",
                                condition=models.Q(blocked_until__gt=NOT_BLOCKED))]

    def __str__(self) -> str:
        return f"{self.account_id} / {self.queue}: {self.in_line} in line of {self.held} held"

    def by_reason(self) -> dict[str, int]:
        """The held jobs out of the line (waiting for a time of their own) by reason, those it holds any of."""
        return {reason: getattr(self, reason) for reason in DeferReason.values if getattr(self, reason)}


class TaskRunDaily(models.Model):
    """Task runs rolled up per day, account, job, queue and outcome (old TaskRun rows are pruned)."""

    day = models.DateField()
    account = models.ForeignKey("budgets.Account", null=True, blank=True, on_delete=models.CASCADE, related_name="+")
    job = models.CharField(max_length=100)
    queue = models.CharField(max_length=40)
    outcome = models.CharField(max_length=20, choices=Outcome.choices)
    runs = models.PositiveIntegerField(default=0)
    cpu_ms = models.BigIntegerField(default=0)
    wall_ms = models.BigIntegerField(default=0)
    db_wait_ms = models.BigIntegerField(default=0)
    storage_wait_ms = models.BigIntegerField(default=0)
    items = models.BigIntegerField(default=0)

    class Meta:
        verbose_name_plural = "task runs per day"
        ordering = ["-day", "job"]
        constraints = [
            models.UniqueConstraint(
                fields=["day", "account", "job", "queue", "outcome"], nulls_distinct=False,
                name="taskrundaily_unique_key",
            )
        ]

    def __str__(self) -> str:
        return f"{self.day} {self.job} {self.outcome}"
