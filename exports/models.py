import uuid

from django.conf import settings
from django.db import models
from django.db.models import Q


class ExportStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


FINISHED_STATUSES = frozenset({ExportStatus.SUCCEEDED, ExportStatus.FAILED, ExportStatus.CANCELLED})


class ExportFormat(models.TextChoices):
    CSV = "csv", "CSV"


class ExportRecord(models.Model):
    """The durable logical result of one export request; attempts come and go, this stays."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False, verbose_name="export id")
    account = models.ForeignKey("budgets.Account", on_delete=models.CASCADE, related_name="exports")
    requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Input scope: inclusive UTC dates.
    start_date = models.DateField(verbose_name="from", help_text="First day of the report, inclusive (UTC)")
    end_date = models.DateField(verbose_name="to", help_text="Last day of the report, inclusive (UTC)")
    format = models.CharField(max_length=10, choices=ExportFormat.choices, default=ExportFormat.CSV)
    source = models.CharField(max_length=40)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True,
        help_text="A repeated request with this key returns this export instead of a new one")

    status = models.CharField(
        max_length=20, choices=ExportStatus.choices, default=ExportStatus.QUEUED, db_index=True
    )
    attempt_count = models.PositiveSmallIntegerField(default=0, verbose_name="attempts", help_text="Tries so far")
    attempt_limit = models.PositiveSmallIntegerField(default=5, verbose_name="attempt limit",
        help_text="After this many failed tries the export fails for good")
    # Lease: the attempt holding epoch `lease_epoch` owns the record until `lease_expires_at`.
    # Every write of an attempt is guarded by its epoch (fencing), so a stale one cannot win.
    lease_owner = models.CharField(max_length=100, blank=True, verbose_name="lease owner",
        help_text="host:pid of the worker whose attempt holds the lease")
    lease_epoch = models.PositiveIntegerField(default=0, verbose_name="lease epoch",
        help_text="Raised with every attempt: only the attempt holding the latest epoch may complete the export")
    lease_expires_at = models.DateTimeField(null=True, blank=True, verbose_name="lease expires",
        help_text="Another attempt may take over after this")

    output_key = models.CharField(max_length=300, blank=True, verbose_name="stored as",
        help_text="The file's key in export storage")
    checksum_sha256 = models.CharField(max_length=64, blank=True, verbose_name="SHA-256 checksum",
        help_text="Of the file as published")
    row_count = models.PositiveBigIntegerField(null=True, blank=True, verbose_name="rows")
    byte_size = models.PositiveBigIntegerField(null=True, blank=True, verbose_name="size (bytes)")
    rows_written = models.PositiveBigIntegerField(default=0, verbose_name="rows written",
        help_text="Progress of the running attempt")
    rows_estimated = models.PositiveBigIntegerField(null=True, blank=True, verbose_name="rows estimated",
        help_text="Counted when the export was requested")
    error_class = models.CharField(max_length=200, blank=True)
    error_message = models.TextField(blank=True, verbose_name="error", help_text="Redacted before it is stored")

    created_at = models.DateTimeField(auto_now_add=True, db_index=True, verbose_name="requested")
    started_at = models.DateTimeField(null=True, blank=True, verbose_name="started")
    completed_at = models.DateTimeField(null=True, blank=True, verbose_name="completed")
    expires_at = models.DateTimeField(null=True, blank=True, verbose_name="expires",
        help_text="When the file is purged")
    cancel_requested_at = models.DateTimeField(null=True, blank=True, help_text="Honoured between batches")
    notified_at = models.DateTimeField(null=True, blank=True, help_text="When the requester was told (once)")

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "idempotency_key"],
                condition=Q(idempotency_key__isnull=False),
                name="export_unique_idempotency_key",
            ),
            models.CheckConstraint(condition=Q(start_date__lte=models.F("end_date")), name="export_start_le_end"),
        ]

    def __str__(self) -> str:
        return f"{self.source} {self.start_date}..{self.end_date} ({self.status})"

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED_STATUSES

    @property
    def progress_percent(self) -> int | None:
        if self.status == ExportStatus.SUCCEEDED:
            return 100
        if not self.rows_estimated:
            return None
        return min(99, int(100 * self.rows_written / self.rows_estimated))


class AttemptOutcome(models.TextChoices):
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    # Lost its lease to a newer attempt; its writes were fenced out.
    SUPERSEDED = "superseded", "Superseded"
    # Completed from an object an earlier attempt had already published (nothing rebuilt).
    RECONCILED = "reconciled", "Reconciled"
    # Stopped by the account's daily CPU cap; the export waits for the next budget day.
    BUDGET_EXHAUSTED = "budget_exhausted", "Budget exhausted"


class ExportAttempt(models.Model):
    """One try at an export, linked to the TaskRun that made it."""

    export = models.ForeignKey(ExportRecord, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveSmallIntegerField(verbose_name="attempt")
    epoch = models.PositiveIntegerField(verbose_name="lease epoch", help_text="The lease epoch this attempt held")
    task_run = models.ForeignKey(
        "scheduling.TaskRun", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    worker = models.CharField(max_length=100, blank=True)
    outcome = models.CharField(max_length=20, choices=AttemptOutcome.choices, default=AttemptOutcome.RUNNING)
    error_class = models.CharField(max_length=200, blank=True)
    error_message = models.TextField(blank=True, verbose_name="error", help_text="Redacted before it is stored")
    rows_written = models.PositiveBigIntegerField(default=0)
    started_at = models.DateTimeField(auto_now_add=True, verbose_name="started")
    finished_at = models.DateTimeField(null=True, blank=True, verbose_name="finished")

    class Meta:
        ordering = ["export", "number"]
        constraints = [
            models.UniqueConstraint(fields=["export", "epoch"], name="attempt_unique_export_epoch")
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.export_id}"


class ActivityEvent(models.Model):
    """Sample account activity, standing in for the host SaaS's own report data."""

    account = models.ForeignKey("budgets.Account", on_delete=models.CASCADE, related_name="+")
    occurred_at = models.DateTimeField()
    actor_email = models.CharField(max_length=254)
    event_type = models.CharField(max_length=50)
    amount = models.DecimalField(max_digits=12, decimal_places=2)
    description = models.TextField(blank=True)

    class Meta:
        indexes = [models.Index(fields=["account", "occurred_at", "id"], name="activity_account_time")]

    def __str__(self) -> str:
        return f"{self.event_type} by {self.actor_email}"


class SchedulePeriod(models.TextChoices):
    DAILY = "daily", "Every day: the day before"
    WEEKLY = "weekly", "Every Monday: the week before"
    MONTHLY = "monthly", "Every 1st: the month before"


class ExportSchedule(models.Model):
    """A recurring export: e.g. yesterday's activity, every day at 01:00 in the account's zone."""

    account = models.ForeignKey("budgets.Account", on_delete=models.CASCADE, related_name="export_schedules")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    source = models.CharField(max_length=40, default="activity")
    format = models.CharField(max_length=10, choices=ExportFormat.choices, default=ExportFormat.CSV)
    period = models.CharField(max_length=10, choices=SchedulePeriod.choices, default=SchedulePeriod.DAILY)
    at_time = models.TimeField(default="01:00", help_text="Local time in the account's time zone")
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.account} {self.source} {self.period} at {self.at_time}"


class DownloadGrant(models.Model):
    """One download link: for one user and one export, usable once, within the link's TTL.

    The link carries the grant's id, signed with its issue time (exports/storage.py); serving it
    marks the grant used under a guarded UPDATE, so a link copied from a log, a proxy or a browser
    history is worth nothing once its user has the file."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    export = models.ForeignKey(ExportRecord, on_delete=models.CASCADE, related_name="download_grants")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    used_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"download of {self.export_id} ({'used' if self.used_at else 'unused'})"
