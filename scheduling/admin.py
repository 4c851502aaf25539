from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.http import HttpResponseRedirect
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.html import format_html

from budgets.models import Role
from budgets.tenancy import ReadOnlyAdmin, accounts_visible_to, action_role
from scheduling import clock
from scheduling.actions import release_held
from scheduling import admin_display
from scheduling.models import DeadLetter, DeferredTask, Pause, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.operator import message_results
from scheduling.object_actions import ObjectActionsAdmin
from scheduling.pausing import pause, resume
from scheduling.waits import hold_shown, why_held


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
    # What fits beside the admin's two sidebars at 1400 px; the items, the worker and each wait are on
    # the run's page.
    list_display = ["job", "ref_short", "account", "outcome", "started", "wall_and_cpu", "split"]
    list_display_links = ["job", "ref_short"]
    list_filter = ["outcome", "job", "queue", "account"]
    search_fields = ["ref", "job", "worker"]
    date_hierarchy = "started_at"
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator
    fieldsets = [
        (None, {"fields": ["job", "ref", "account", "queue", "outcome_explained", "started_at", "finished_at", "worker"]}),
        ("Where the time went", {"fields": ["wall_ms", "cpu_ms", "db_wait_ms", "storage_wait_ms", "split", "items",
                                            "peak_rss_kb"]}),
        ("Error", {"fields": ["error_class", "error_message"]}),
    ]

    def get_fieldsets(self, request, obj=None):
        if obj is not None and not (obj.error_class or obj.error_message):
            return [entry for entry in self.fieldsets if entry[0] != "Error"]  # no empty section on success
        return self.fieldsets

    @admin.display(description="reference")
    def ref_short(self, obj):
        return admin_display.short_id(obj.ref)

    @admin.display(description="started", ordering="started_at")
    def started(self, obj):
        return admin_display.short_time(obj.started_at)

    @admin.display(description="wall / CPU (ms)", ordering="wall_ms")
    def wall_and_cpu(self, obj):
        return format_html('<span class="nowrap">{} / {}</span>', obj.wall_ms, obj.cpu_ms)

    @admin.display(description="outcome")
    def outcome_explained(self, obj):
        return admin_display.outcome_explained(obj)

    @admin.display(description="CPU / DB / storage (%)")
    def split(self, obj):
        total = obj.cpu_ms + obj.db_wait_ms + obj.storage_wait_ms
        if not total:
            return "—"
        return "/".join(f"{round(100 * part / total)}" for part in (obj.cpu_ms, obj.db_wait_ms, obj.storage_wait_ms))


@admin.register(DeferredTask)
class DeferredTaskAdmin(admin_display.LabelledAdmin, ObjectActionsAdmin, ReadOnlyAdmin):
    """The holding area: why is this waiting, and from when may it run? A job's reason and time
    are read through `scheduling.waits.hold_shown` alone (for a job in line: what its line waits for now)."""

    help_texts = {
        "reason_shown": "Why it waits now: for a job in its account's line, what holds the line now (its "
                        "daily CPU budget spent, its rate limit, its cap, a pause, busy workers); else its own reason",
        "eligible_from": "Released to the queue at this time, or when what is named happens",
    }

    list_display = ["job", "ref_short", "account", "queue", "reason_shown", "eligible_from", "held_since"]
    list_display_links = ["job", "ref_short"]
    list_filter = ["reason", "queue", "job", "account", "envelope_version"]
    search_fields = ["ref", "job"]
    list_select_related = ["account"]
    show_full_result_count = False
    paginator = CappedPaginator
    actions = ["release"]
    fieldsets = [
        (None, {"fields": ["job", "ref", "account", "queue", "reason_shown", "eligible_from", "priority"]}),
        # Not its `eligible_at`: a job in its account's line goes by its line's time ("eligible from",
        # above), and its own copy, long past, read as a second and contradictory time.
        ("Its record in the holding area", {"fields": ["reason", "in_line_since", "deferrals", "created_at",
                                                       "envelope_version", "claimed_by", "claim_expires_at"],
                                            "classes": ["collapse"]}),
    ]

    def get_changelist(self, request, **kwargs):
        return _WaitsChangeList

    def changelist_view(self, request, extra_context=None):
        # The place is the holding area; what it counts are held jobs ("Select all 64 held jobs").
        return super().changelist_view(request, {"title": "Holding area: held jobs, why they wait, from when they may run",
                                                 "module_name": "held jobs", **(extra_context or {})})

    @admin.display(description="reference")
    def ref_short(self, obj):
        return admin_display.short_id(obj.ref)

    @admin.display(description="held since", ordering="created_at")
    def held_since(self, obj):
        return admin_display.short_time(obj.created_at)

    @admin.display(description="why it waits")
    def reason_shown(self, obj):
        return self._shown(obj, clock.now()).reason  # held work's times are on the kernel's (shiftable) clock

    @admin.display(description="eligible from")
    def eligible_from(self, obj):
        now = clock.now()
        return admin_display.eligible_from(self._shown(obj, now), now=now)

    def _shown(self, obj, now):
        """What it waits for, as the list read it for every row at once, or (its own page) for it alone."""
        return hold_shown(obj, now=now, wait=getattr(obj, "wait", None))

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
class TaskRunDailyAdmin(admin_display.LabelledAdmin, ReadOnlyAdmin):
    labels = {"cpu_ms": "CPU time (ms)", "wall_ms": "wall time (ms)", "db_wait_ms": "database wait (ms)",
              "storage_wait_ms": "storage wait (ms)"}
    list_display = ["day", "job", "account", "queue", "outcome", "runs", "cpu_ms", "wall_ms", "db_wait_ms",
                    "storage_wait_ms", "items"]
    list_filter = ["outcome", "job", "queue"]
    date_hierarchy = "day"


@admin.register(WorkerHeartbeat)
class WorkerHeartbeatAdmin(admin_display.LabelledAdmin, ReadOnlyAdmin):
    labels = {"seen_at": "last seen", "stalled_since": "stalled since"}
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
