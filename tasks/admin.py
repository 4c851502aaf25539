import json

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.utils.html import format_html, format_html_join

from budgets.models import Role
from budgets.tenancy import ReadOnlyAdmin, action_role
from scheduling import admin_display, clock
from scheduling.object_actions import ObjectActionsAdmin, button
from scheduling.operator import message_results
from scheduling.redaction import redact
from scheduling.waits import hold_shown
from tasks.models import TaskCall
from tasks.operations import call_cancel, call_retry
from tasks.selectors import holds_of


class _HoldsChangeList(ChangeList):
    """The change list, with each READY call's hold (reason and ETA) read for the page at once."""

    def get_results(self, request):
        super().get_results(request)
        holds = holds_of(self.result_list)
        for call in self.result_list:
            call.held = holds.get(str(call.pk))


@admin.register(TaskCall)
class TaskCallAdmin(ObjectActionsAdmin, ReadOnlyAdmin):
    """Django task calls, scoped per account like every record (a system call, which belongs to no
    account, only for superusers); written by the system, so read-only but for retry and cancel."""

    # What fits beside the admin's two sidebars at 1400 px: the queue is a filter, the finish time
    # goes with the status.
    list_display = ["short_id", "task", "account", "status_shown", "waiting", "attempts", "enqueued"]
    list_filter = ["status", "queue", "account"]
    search_fields = ["id", "task_path", "account__slug"]
    date_hierarchy = "enqueued_at"
    list_select_related = ["account"]
    actions = ["retry", "cancel"]
    fieldsets = [
        (None, {"fields": ["id", "task_path", "backend", "account", "queue", "priority", "run_after", "status",
                           "waiting"]}),
        ("Call", {"fields": ["arguments_shown", "result_shown", "errors_shown"]}),
        ("Attempts", {"fields": ["attempt_count", "attempt_limit", "workers", "run", "enqueued_at", "sent_at",
                                 "started_at", "last_attempted_at", "finished_at"]}),
    ]

    def object_action_applies(self, obj, name: str) -> bool:
        return obj.status == {"retry": "FAILED", "cancel": "READY"}.get(name)

    def get_changelist(self, request, **kwargs):
        return _HoldsChangeList

    @admin.action(description="Retry selected failed task calls", permissions=["act"])
    @button("Retry this call")
    @action_role(Role.OPERATOR)
    def retry(self, request, queryset):
        message_results(self, request, call_retry(user=request.user, call_ids=list(queryset.values_list("pk", flat=True))))

    @admin.action(description="Cancel selected task calls that have not started", permissions=["act"])
    @button("Cancel this call")
    @action_role(Role.OPERATOR)
    def cancel(self, request, queryset):
        message_results(self, request, call_cancel(user=request.user, call_ids=list(queryset.values_list("pk", flat=True))))

    def has_act_permission(self, request):
        """Retry and cancel act on work: whoever sees calls and holds the operator role in an account
        (each selected call is checked against its account)."""
        return self.has_view_permission(request) and self.has_role(request, Role.OPERATOR)

    @admin.display(description="call id", ordering="id")
    def short_id(self, obj):
        return admin_display.short_id(obj.pk)

    @admin.display(description="enqueued", ordering="enqueued_at")
    def enqueued(self, obj):
        return admin_display.short_time(obj.enqueued_at)

    @admin.display(description="status", ordering="status")
    def status_shown(self, obj):
        if obj.finished_at is None:
            return obj.get_status_display()
        return format_html("{} {}", obj.get_status_display(), admin_display.short_time(obj.finished_at))

    @admin.display(description="task")
    def task(self, obj):
        return obj.task_path.rsplit(".", 1)[-1]

    @admin.display(description="attempts")
    def attempts(self, obj):
        return f"{len(obj.worker_ids)} of {obj.attempt_limit}" if obj.worker_ids else "—"

    @admin.display(description="waiting")
    def waiting(self, obj):
        """Why a READY call waits, and for what: the broker, or the holding area's reason and ETA."""
        if obj.status != "READY":
            return "—"
        held = obj.held if hasattr(obj, "held") else holds_of([obj]).get(str(obj.pk))  # change page: its own
        if held is None:
            return "in the queue"
        now = clock.now()  # held work's times are on the kernel's (shiftable) clock
        shown = hold_shown(held, now=now, wait=held.wait)
        when = admin_display.eligible_from(shown, now=now)
        return f"{shown.reason}, eligible from {when}" if shown.eligible_from else f"{shown.reason}, {when}"

    # Arguments and return values are shown redacted (e-mail addresses, tokens, card numbers): tasks
    # should be given ids, and what a host passed anyway is not spelt out to everyone who sees the call.
    @admin.display(description="arguments")
    def arguments_shown(self, obj):
        return _pre(redact(json.dumps(obj.arguments, indent=2, ensure_ascii=False), max_length=4000))

    @admin.display(description="return value")
    def result_shown(self, obj):
        if obj.status != "SUCCESSFUL":
            return "—"
        return _pre(redact(json.dumps(obj.return_value, indent=2, ensure_ascii=False), max_length=4000))

    @admin.display(description="errors (one per failed attempt, redacted)")
    def errors_shown(self, obj):
        if not obj.errors:
            return "—"
        return format_html_join("", "<p><b>{}</b></p><pre>{}</pre>",
                                ((e["exception_class_path"], e["traceback"]) for e in obj.errors))


def _pre(text: str):
    return format_html("<pre>{}</pre>", text)
