from django.contrib import admin, messages
from django.utils.timesince import timeuntil

from budgets.tenancy import ReadOnlyAdmin
from scheduling import clock
from scheduling.holding import release_now
from scheduling.models import DeferReason, DeferredTask, TaskRun, TaskRunDaily, WorkerHeartbeat


@admin.register(TaskRun)
class TaskRunAdmin(ReadOnlyAdmin):
    list_display = ["job", "account", "outcome", "started_at", "wall_ms", "cpu_ms", "db_wait_ms",
                    "storage_wait_ms", "items", "worker"]
    list_filter = ["outcome", "job", "queue", "account"]
    search_fields = ["ref", "job", "worker"]
    date_hierarchy = "started_at"
    list_select_related = ["account"]
    show_full_result_count = False


@admin.register(DeferredTask)
class DeferredTaskAdmin(ReadOnlyAdmin):
    """The holding area: why is this waiting, and until when?"""

    list_display = ["job", "ref", "account", "queue", "reason", "eligible_at", "eta", "deferrals",
                    "envelope_version", "created_at"]
    list_filter = ["reason", "queue", "job", "account", "envelope_version"]
    search_fields = ["ref", "job"]
    list_select_related = ["account"]
    actions = ["release"]

    @admin.display(description="ETA")
    def eta(self, obj):
        now = clock.now()  # held work's times are on the kernel's (shiftable) clock
        if obj.reason == DeferReason.NEEDS_NEWER_WORKER:
            return f"when a worker that speaks envelope v{obj.envelope_version} runs"
        if obj.eligible_at <= now:
            return "when a slot frees"
        return f"in {timeuntil(obj.eligible_at, now)}"

    @admin.action(description="Release now (back to the queue)")
    def release(self, request, queryset):
        count = release_now(deferred_ids=list(queryset.values_list("pk", flat=True)))
        self.message_user(request, f"Released {count} held task(s).", messages.SUCCESS)

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
    list_display = ["worker", "queue", "seen_at"]
    list_filter = ["queue"]
    account_path = None
