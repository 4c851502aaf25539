import hashlib
import secrets
import zoneinfo

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone as django_timezone


def validate_timezone(value: str) -> None:
    """An IANA zone name this machine knows (recurring exports compute their periods in it)."""
    if value not in zoneinfo.available_timezones():
        raise ValidationError("Unknown time zone %(zone)s; use an IANA name such as Europe/Amsterdam.",
                              code="unknown_timezone", params={"zone": repr(value)[:70]})


class Plan(models.TextChoices):
    FREE = "free", "Free"
    STANDARD = "standard", "Standard"
    ENTERPRISE = "enterprise", "Enterprise"


class Account(models.Model):
    """A tenant: every task, export and budget belongs to one. Saved only with a known time zone
    (`save` validates it: a bad zone written by any path must not reach the recurring exports)."""

    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    is_active = models.BooleanField(default=True)
    plan = models.CharField(max_length=20, choices=Plan.choices, default=Plan.STANDARD)
    timezone = models.CharField(max_length=64, default="UTC", validators=[validate_timezone],
                                help_text="For recurring exports, e.g. Europe/Amsterdam")
    export_retention_days = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="Days finished exports are kept; empty = the default")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    def save(self, *args, **kwargs):
        validate_timezone(self.timezone)
        super().save(*args, **kwargs)


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    OPERATOR = "operator", "Operator"
    OWNER = "owner", "Owner"


# Roles allowed to request exports of an account's data.
EXPORT_ROLES = frozenset({Role.OPERATOR, Role.OWNER})


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.VIEWER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "account"], name="membership_unique_user_account")
        ]

    def __str__(self) -> str:
        return f"{self.user} @ {self.account} ({self.role})"

    @property
    def can_export(self) -> bool:
        return self.role in EXPORT_ROLES


class Queue(models.TextChoices):
    """The django-q2 clusters Fairshare runs; each has its own budgets and worker pool."""

    DEFAULT = "default", "default"
    EXPORTS = "exports", "exports"


class Budget(models.Model):
    """An account's daily allowance on one queue (enforced by admission, see SPEC §4)."""

    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="budgets")
    queue = models.CharField(max_length=40, choices=Queue.choices)
    cpu_seconds_per_day = models.PositiveIntegerField()
    max_concurrent = models.PositiveSmallIntegerField()
    weight = models.PositiveSmallIntegerField(
        default=1, help_text="Its share of busy workers against other accounts' (1 or more): "
                             "weight 3 gets three times the worker time of weight 1 when both wait")
    rate_starts = models.PositiveIntegerField(
        null=True, blank=True, help_text="At most this many runs start per rate period; empty: no rate limit")
    rate_period_s = models.PositiveIntegerField(default=60, help_text="The rate limit's window, in seconds")

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["account", "queue"], name="budget_unique_account_queue"),
            models.CheckConstraint(condition=models.Q(weight__gte=1, rate_period_s__gte=1),
                                   name="budget_weight_and_rate_period_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.account} / {self.queue}"


class UsageDay(models.Model):
    """The usage ledger: one row per account, queue and budget day.

    Changed only by atomic SQL (`F()` updates under the budget's row lock), never read-modify-write.
    """

    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="usage_days")
    queue = models.CharField(max_length=40, choices=Queue.choices)
    day = models.DateField()
    cpu_used_ms = models.BigIntegerField(default=0)
    cpu_reserved_ms = models.BigIntegerField(default=0)
    wall_ms = models.BigIntegerField(default=0)
    db_wait_ms = models.BigIntegerField(default=0)
    storage_wait_ms = models.BigIntegerField(default=0)
    runs = models.PositiveIntegerField(default=0)
    deferrals = models.PositiveIntegerField(default=0)
    cap_hits = models.PositiveIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["account", "queue", "day"], name="usageday_unique_account_queue_day")
        ]
        # The dashboard reads the last 14 days of every account: by day, whatever the history holds.
        # Its index carries the account and queue too, so that a lookup of one row (account, queue,
        # day) reads one row whichever index the planner takes: on a new day that the statistics do
        # not know yet, both look like one row, and an index of the day alone would read all of the
        # day's rows for each (tests/budgets/test_queries.py).
        indexes = [models.Index(fields=["day", "account", "queue"], name="usageday_day_account_queue")]
        ordering = ["-day", "account", "queue"]

    def __str__(self) -> str:
        return f"{self.account} / {self.queue} / {self.day}"


class ReservationStatus(models.TextChoices):
    # Sent to the broker, not started yet: holds one of the account's slots, no CPU, so a flood
    # waits in the holding area instead of the broker. Taken over by the run's admission; given
    # back if the message is not picked up within FAIRSHARE["DISPATCH_LEASE_S"] (it was lost).
    DISPATCHED = "dispatched", "Dispatched (holds a slot, not started)"
    ACTIVE = "active", "Active (holds a slot)"
    # The run stopped renewing its lease (its worker died): slot and reservation were given back and
    # the CPU it had reported was charged. If it turns out to be alive after all, its settlement
    # charges only the remainder.
    RECLAIMED = "reclaimed", "Reclaimed"


class Reservation(models.Model):
    """A task's concurrency slot, from dispatch (or admission) to settlement, and the CPU its run
    has reserved."""

    # No index of its own: reservation_slots starts with the account (and a second index on it
    # is one more the planner may take for a job's own slot, reading every slot of the account).
    account = models.ForeignKey(Account, on_delete=models.CASCADE, related_name="reservations", db_index=False)
    queue = models.CharField(max_length=40, choices=Queue.choices)
    day = models.DateField(help_text="The budget day the run is charged to")
    job = models.CharField(max_length=100)
    ref = models.CharField(max_length=64, blank=True)
    task_run = models.OneToOneField("scheduling.TaskRun", null=True, blank=True, on_delete=models.SET_NULL, related_name="reservation")
    worker = models.CharField(max_length=100, blank=True)
    status = models.CharField(max_length=20, choices=ReservationStatus.choices, default=ReservationStatus.ACTIVE)
    cpu_reserved_ms = models.BigIntegerField(default=0)
    cpu_reported_ms = models.BigIntegerField(default=0, db_default=0, help_text="CPU the run had used when it last renewed its lease")
    cpu_charged_ms = models.BigIntegerField(default=0, db_default=0, help_text="CPU already charged by a reclaim")
    # What the runs this slot was passed on from measured and its day's usage row has not been
    # charged yet (budgets.ledger, "carried charges"): their CPU is still in the day's reserved CPU,
    # so the cap counts it. Whoever ends the slot (its settlement, reclaim or undone admission)
    # charges it; a pass-on carries it on for at most FAIRSHARE["CHARGE_CARRY_S"] from `carried_since`.
    carried_runs = models.IntegerField(default=0, db_default=0)
    carried_cpu_ms = models.BigIntegerField(default=0, db_default=0)
    carried_wall_ms = models.BigIntegerField(default=0, db_default=0)
    carried_db_wait_ms = models.BigIntegerField(default=0, db_default=0)
    carried_storage_wait_ms = models.BigIntegerField(default=0, db_default=0)
    carried_since = models.DateTimeField(null=True, blank=True, help_text="When the first run it carries ended")
    created_at = models.DateTimeField(auto_now_add=True)
    lease_expires_at = models.DateTimeField()

    class Meta:
        # The slots of an account on a queue, by status, and a job's own slot by its (job, ref)
        # among them: what every enqueue and admission looks up. With (job, ref) in the index the
        # lookup reads one entry instead of every slot of the account (its backlog in the broker).
        indexes = [
            models.Index(fields=["account", "queue", "status", "job", "ref"], name="reservation_slots"),
            # "A job sent to the broker waits for a worker" (budgets.ledger): slots by age (the old
            # ones are those in flight a while). Not led by, or partial on, the status: the planner
            # would take such an index for a job's own slot or the running count too, before the
            # table has statistics, and read every slot of that status.
            models.Index(fields=["created_at"], name="reservation_age"),
            # The reclaim's question, every minute: whose lease expired?
            models.Index(fields=["lease_expires_at"], name="reservation_lease"),
            # The enqueue check's question, every enqueue: how many slots of the queue are taken
            # (budgets.ledger.idle_workers, which names this index's expression as it is written
            # here)? Index-only, the queue's slots in flight. Led by that expression, which no other
            # statement names, and not by the queue or the status (see above): the planner, without
            # statistics, took an index on (queue, status) for a job's own slot, reading every slot
            # of the queue (tests/budgets/test_lean_chain.py).
            models.Index(models.ExpressionWrapper(~models.Q(status="reclaimed"), output_field=models.BooleanField()),
                         models.F("queue"), name="reservation_in_flight"),
        ]

    def __str__(self) -> str:
        return f"{self.job} {self.ref} ({self.status})"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


class ApiToken(models.Model):
    """A bearer token for the JSON API: one user acting for one account (SPEC §3). Only its SHA-256
    is stored; the raw token is shown once, to the user it belongs to. It may expire; revoked
    tokens are kept, marked with who revoked them and when."""

    PREFIX = "fs_"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    # Null only for tokens made before tokens had an account: those act for nobody.
    account = models.ForeignKey(Account, null=True, on_delete=models.CASCADE, related_name="api_tokens")
    name = models.CharField(max_length=100)
    key_hash = models.CharField(max_length=64, unique=True, editable=False)
    hint = models.CharField(max_length=12, editable=False, help_text="First characters, to tell tokens apart.")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Empty: does not expire")
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, editable=False,
                                   on_delete=models.SET_NULL, related_name="+")

    def __str__(self) -> str:
        return f"{self.name} ({self.hint}…)"

    @property
    def is_usable(self) -> bool:
        return (self.revoked_at is None and self.account_id is not None
                and (self.expires_at is None or self.expires_at > django_timezone.now()))

    @classmethod
    def issue(cls, *, user, account: Account, name: str, expires_at=None) -> tuple["ApiToken", str]:
        raw = cls.PREFIX + secrets.token_urlsafe(32)
        token = cls.objects.create(user=user, account=account, name=name, key_hash=hash_token(raw),
                                   hint=raw[:8], expires_at=expires_at)
        return token, raw


class BudgetAdjustment(models.Model):
    """An operator's change of a budget's daily CPU limit (budgets.adjust), kept as its history:
    for good, or for one budget day (`until_day`), after which `budgets.end_adjustments` puts
    `previous_cpu_seconds` back."""

    budget = models.ForeignKey(Budget, on_delete=models.CASCADE, related_name="adjustments")
    cpu_seconds_per_day = models.PositiveIntegerField()
    previous_cpu_seconds = models.PositiveIntegerField()
    until_day = models.DateField(null=True, blank=True, help_text="Empty: for good")
    ended_at = models.DateTimeField(null=True, blank=True, help_text="When the day's limit was put back (or superseded)")
    adjusted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        scope = f"for {self.until_day} only" if self.until_day else "for good"
        return f"{self.budget}: {self.previous_cpu_seconds} -> {self.cpu_seconds_per_day} CPU s/day {scope}"
