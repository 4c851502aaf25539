from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.functional import cached_property

from budgets.models import Role
from budgets.tenancy import ReadOnlyAdmin, accounts_visible_to, action_role
from scheduling import clock
from scheduling.actions import release_held
from scheduling.models import DeferReason, DeferredTask, Pause, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.operator import message_results
from scheduling.gates import Wait
from scheduling.pausing import pause, resume
from scheduling.waits import eta_text, why_held


class CappedPaginator(Paginator):
    """Counts at most CAP rows: a list of the holding area or of task runs pages through what may
    be millions of rows, and Django's own paginator would count them all on every page."""

    CAP = 10_000

    @cached_property
    def count(self) -> int:
        return self.object_list[:self.CAP + 1].count()


class _WaitsChangeList(ChangeList):
    """The holding area's list, with what each held job waits for read for the page at once (one
    explanation per line shown: scheduling.waits)."""

    def get_results(self, request):
        super().get_results(request)
        waits = why_held(list(self.result_list))
        for held in self.result_list:
            held.wait = waits[held.pk]


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

    list_display = ["job", "ref", "account", "queue", "waiting_for", "eta", "priority", "deferrals",
                    "envelope_version", "created_at"]
    list_filter = ["reason", "queue", "job", "account", "envelope_version"]
    search_fields = ["ref", "job"]
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator
    actions = ["release"]

    def get_changelist(self, request, **kwargs):
        return _WaitsChangeList

    def get_fields(self, request, obj=None):
        """What it waits for now first (its own page), then the record."""
        return list(dict.fromkeys(["waiting_for", "eta", *super().get_fields(request, obj)]))

    def get_readonly_fields(self, request, obj=None):
        return ["waiting_for", "eta", *super().get_readonly_fields(request, obj)]

    def _wait(self, obj) -> Wait:
        """Its wait as the page read it for every row at once, or (its own page) for it alone."""
        if not hasattr(obj, "wait"):
            obj.wait = why_held([obj])[obj.pk]
        return obj.wait

    @admin.display(description="waiting for")
    def waiting_for(self, obj):
        """Its line's reason now (scheduling.waits), not the one it was held for."""
        wait = self._wait(obj)
        return DeferReason(wait.reason).label if wait.reason in DeferReason.values else wait.reason

    @admin.display(description="ETA")
    def eta(self, obj):
        if obj.reason == DeferReason.NEEDS_NEWER_WORKER:
            return f"when a worker that speaks envelope v{obj.envelope_version} runs"
        return eta_text(self._wait(obj), clock.now()) or "—"  # held work's times: the kernel's clock

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
