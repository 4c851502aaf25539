"""django-q2's own tables in the admin, scoped, redacted and read-only (replacing django_q.admin).

django-q2's pages showed every account's tasks to any staff member, printed stored tracebacks as
they were, and offered "resubmit", which re-sends a raw task past our envelope, gates and budgets.
Here: a task row belongs to the account named by its group (`scheduling.broker.send` sets
"account-<id>"), results are shown redacted, nothing can be added, changed or resubmitted (work is
run again through our services: retry, release), and the queue and the cron schedules - the
platform's, not a tenant's - are for superusers only.
"""
from django.contrib import admin
from django.db.models import OuterRef, Subquery, Value
from django.db.models.functions import Concat, Substr
from django.utils.html import format_html
from django_q.models import Failure, OrmQ, Schedule, Success

from budgets.tenancy import ReadOnlyAdmin, accounts_with_role
from scheduling.actions import run_schedule_now
from scheduling.models import TaskRun
from scheduling.operator import message_results
from scheduling.redaction import LOG_MAX_LENGTH, redact
from scheduling.broker import ACCOUNT_GROUP
from scheduling.schedules import PREFIX

for model in (Success, Failure, Schedule, OrmQ):
    if admin.site.is_registered(model):
        admin.site.unregister(model)


class QTaskAdmin(ReadOnlyAdmin):
    list_display = ["name", "func", "account", "started", "stopped", "attempt_count", "short_result"]
    fields = ["id", "name", "func", "account", "started", "stopped", "attempt_count", "redacted_result"]
    readonly_fields = fields
    search_fields = ["name", "func"]
    actions = []  # no raw resubmit

    def scope(self, request, queryset, role="viewer"):
        if request.user.is_superuser:
            return queryset
        accounts = accounts_with_role(user=request.user, role=role).values_list("pk", flat=True)
        return queryset.filter(group__in=[ACCOUNT_GROUP.format(pk) for pk in accounts])

    def has_role(self, request, role, obj=None):
        if request.user.is_superuser:
            return True
        if obj is None:
            return accounts_with_role(user=request.user, role=role).exists()
        return self.scope(request, self.model._default_manager.filter(pk=obj.pk), role).exists()

    def get_list_filter(self, request):
        return []  # a group filter would list other accounts' groups

    @admin.display(description="account")
    def account(self, obj):
        return (obj.group or "").removeprefix(ACCOUNT_GROUP.format("")) or "—"

    @admin.display(description="result")
    def short_result(self, obj):
        return redact(str(obj.result or ""), max_length=120)

    @admin.display(description="result (redacted)")
    def redacted_result(self, obj):
        return format_html("<pre>{}</pre>", redact(str(obj.result or ""), max_length=LOG_MAX_LENGTH))


admin.site.register(Success, QTaskAdmin)
admin.site.register(Failure, QTaskAdmin)


@admin.register(Schedule)
class QScheduleAdmin(ReadOnlyAdmin):
    """The cron schedules are declared in code (`sync_schedules`): inspect them here, with their
    last run from our own TaskRun records (with `save_limit: -1` django-q2 keeps no success rows,
    so its own "last run" stays empty), and run one now."""

    account_path = None
    list_display = ["name", "func", "schedule_type", "cron", "cluster", "next_run", "last_run", "last_outcome",
                    "last_duration"]
    actions = ["run_now"]

    def get_queryset(self, request):
        # A Fairshare schedule fires its job with ref "schedule:<name>" (scheduling.schedules).
        runs = TaskRun.objects.filter(ref=OuterRef("run_ref")).order_by("-started_at")
        return super().get_queryset(request).annotate(
            run_ref=Concat(Value("schedule:"), Substr("name", len(PREFIX) + 1)),
            last_started_at=Subquery(runs.values("started_at")[:1]),
            last_run_outcome=Subquery(runs.values("outcome")[:1]),
            last_wall_ms=Subquery(runs.values("wall_ms")[:1]),
        )

    @admin.display(description="last run (our records)", ordering="last_started_at")
    def last_run(self, obj):
        return obj.last_started_at

    @admin.display(description="outcome")
    def last_outcome(self, obj):
        return obj.last_run_outcome or "—"

    @admin.display(description="duration")
    def last_duration(self, obj):
        return "—" if obj.last_wall_ms is None else f"{obj.last_wall_ms / 1000:.2f} s"

    @admin.action(description="Run now (once; the timetable is unchanged)")
    def run_now(self, request, queryset):
        message_results(self, request, [run_schedule_now(user=request.user, schedule_id=pk)
                                        for pk in queryset.values_list("pk", flat=True)])


@admin.register(OrmQ)
class QQueueAdmin(ReadOnlyAdmin):
    """The ORM broker's queue: what waits for a worker (envelopes, never customer data)."""

    account_path = None
    list_display = ["id", "key", "name", "lock"]
    fields = ["id", "key", "name", "lock"]
    readonly_fields = fields
