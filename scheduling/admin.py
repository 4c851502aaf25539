from django.contrib import admin
from django.core.paginator import Paginator
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.timesince import timeuntil

from budgets.models import Role
from budgets.tenancy import ReadOnlyAdmin, accounts_visible_to, action_role
from scheduling import clock
from scheduling.actions import release_held
from scheduling.models import DeadLetter, DeferReason, DeferredTask, Pause, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.operator import message_results
from scheduling.pausing import UNTIL_RESUMED, pause, resume
from scheduling.selectors import line_held_up, with_their_line


class CappedPaginator(Paginator):
    """Counts at most CAP rows: a list of the holding area or of task runs pages through what may
    be millions of rows, and Django's own paginator would count them all on every page."""

    CAP = 10_000

    @cached_property
    def count(self) -> int:
        return self.object_list[:self.CAP + 1].count()


@admin.register(TaskRun)
class TaskRunAdmin(ReadOnlyAdmin):
    list_display = ["job", "account", "outcome", "started_at", "wall_ms", "cpu_ms", "db_wait_ms",
                    "storage_wait_ms", "split", "items", "worker"]
    list_filter = ["outcome", "job", "queue", "account"]
    search_fields = ["ref", "job", "worker"]
    date_hierarchy = "started_at"
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator

    @admin.display(description="CPU / DB / storage")
    def split(self, obj):
        total = obj.cpu_ms + obj.db_wait_ms + obj.storage_wait_ms
        if not total:
            return "—"
        return " / ".join(f"{round(100 * part / total)}%" for part in (obj.cpu_ms, obj.db_wait_ms, obj.storage_wait_ms))


@admin.register(DeferredTask)
class DeferredTaskAdmin(ReadOnlyAdmin):
    """The holding area: why is this waiting, and until when?"""

    list_display = ["job", "ref", "account", "queue", "reason", "eligible_at", "eta", "priority", "deferrals",
                    "envelope_version", "created_at"]
    list_filter = ["reason", "queue", "job", "account", "envelope_version"]
    search_fields = ["ref", "job"]
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator
    actions = ["release"]

    def get_queryset(self, request):
        return with_their_line(super().get_queryset(request))

    @admin.display(description="ETA")
    def eta(self, obj):
        now = clock.now()  # held work's times are on the kernel's (shiftable) clock
        if obj.reason == DeferReason.NEEDS_NEWER_WORKER:
            return f"when a worker that speaks envelope v{obj.envelope_version} runs"
        if obj.in_line_since is None:  # it waits for a time of its own
            return "when resumed" if obj.eligible_at >= UNTIL_RESUMED else f"in {timeuntil(obj.eligible_at, now)}"
        held_up = line_held_up(obj, now)
        if held_up is not None:
            until, why = held_up
            return f"in {timeuntil(until, now)} (its account's {why})"
        return "when a slot frees"

    @admin.action(description="Release now (back to the queue)", permissions=["release"])
    @action_role(Role.OPERATOR)
    def release(self, request, queryset):
        message_results(self, request, release_held(user=request.user, deferred_ids=list(queryset.values_list("pk", flat=True))))

    def has_release_permission(self, request):
        """Releasing acts on work, not on the record's fields: whoever sees the holding area and is
        an operator somewhere (each selected job is checked against its account)."""
        return self.has_view_permission(request) and self.has_role(request, Role.OPERATOR)

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(TaskRunDaily)
class TaskRunDailyAdmin(ReadOnlyAdmin):
    list_display = ["day", "job", "account", "queue", "outcome", "runs", "cpu_ms", "wall_ms", "db_wait_ms",
                    "storage_wait_ms", "items"]
    list_filter = ["outcome", "job", "queue"]
    date_hierarchy = "day"


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(ReadOnlyAdmin):
    list_display = ["worker", "queue", "seen_at", "stalled_since"]
    list_filter = ["queue"]
    account_path = None


@admin.register(Pause)
class PauseAdmin(ReadOnlyAdmin):
    """Paused accounts and queues. Add one to pause (a queue: leave the account empty); the
    resume action lifts it and releases its held work."""

    list_display = ["__str__", "account", "queue", "paused_by", "created_at"]
    fields = ["account", "queue"]
    actions = ["resume_selected"]

    def has_add_permission(self, request, obj=None):
        return True  # the pause service checks the role for the chosen account (a queue: superusers)

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "account":  # a tenant chooses among its own accounts only
            kwargs["queryset"] = accounts_visible_to(user=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def save_model(self, request, obj, form, change):
        result = pause(user=request.user, account=obj.account, queue=obj.queue)
        message_results(self, request, [result])
        obj.pk = Pause.objects.filter(account=obj.account, queue=obj.queue).values_list("pk", flat=True).first()

    def log_addition(self, request, obj, message):
        pass  # the pause service wrote the log entry

    def response_add(self, request, obj, post_url_continue=None):
        # Back to the list, where the service's result is shown (a refused pause has no object).
        return HttpResponseRedirect(reverse("admin:scheduling_pause_changelist"))

    @admin.action(description="Resume: lift the pause and release its held work")
    @action_role(Role.OPERATOR)
    def resume_selected(self, request, queryset):
        message_results(self, request, [resume(user=request.user, account=p.account, queue=p.queue) for p in queryset])


from scheduling import q2_admin  # noqa: E402,F401  (replaces django-q2's own admin pages)


@admin.register(DeadLetter)
class DeadLetterAdmin(ReadOnlyAdmin):
    """RabbitMQ messages nobody could honour, with why; the messages wait in their dead-letter queues
    (scheduling.dead_letters). An account's members see those that named their account."""

    list_display = ["first_seen_at", "queue", "reason", "account", "message_id", "body_bytes", "deliveries"]
    list_filter = ["queue", "account"]
    search_fields = ["message_id", "reason"]
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator
