from django import forms
from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from budgets.models import Role
from budgets.tenancy import AccountScopedAdmin, ReadOnlyAdmin, action_role, can_export
from exports.models import ActivityEvent, ExportAttempt, ExportRecord, ExportSchedule, ExportStatus
from exports.operations import RETRYABLE, export_cancel_by, export_retry, export_schedule_run_now
from scheduling import admin_display
from scheduling.object_actions import ObjectActionsAdmin, button
from scheduling.operator import message_results

FAILURE = "Failure"


class ExportAttemptInline(admin.TabularInline):
    model = ExportAttempt
    extra = 0
    can_delete = False
    fields = ["number", "epoch", "outcome", "rows_written", "error_class", "error_message", "worker",
              "task_run", "started_at", "finished_at"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(ExportRecord)
class ExportRecordAdmin(ObjectActionsAdmin, ReadOnlyAdmin):
    list_display = ["short_id", "account", "status_shown", "report_dates", "attempts", "row_count", "requested"]
    list_filter = ["status", "account", "source"]
    search_fields = ["id", "idempotency_key", "account__slug"]
    date_hierarchy = "created_at"
    list_select_related = ["account"]
    inlines = [ExportAttemptInline]
    actions = ["retry", "cancel"]
    fieldsets = [
        (None, {"fields": ["id", "account", "requested_by", "source", "format", "start_date", "end_date",
                           "idempotency_key", "status", "progress", "timings"]}),
        ("Result", {"fields": ["download", "output_key", "row_count", "byte_size", "checksum_sha256", "completed_at",
                               "expires_at"]}),
        (FAILURE, {"fields": ["error_class", "error_message"]}),
        ("Attempts and lease", {"fields": ["attempt_count", "attempt_limit", "lease_owner", "lease_epoch",
                                           "lease_expires_at", "rows_written", "rows_estimated", "created_at",
                                           "started_at"], "classes": ["collapse"]}),
    ]

    def object_action_applies(self, obj, name: str) -> bool:
        return obj.status in {"retry": RETRYABLE, "cancel": (ExportStatus.QUEUED, ExportStatus.RUNNING)}.get(name, ())

    def get_fieldsets(self, request, obj=None):
        if obj is not None and not (obj.error_class or obj.error_message):
            return [entry for entry in self.fieldsets if entry[0] != FAILURE]  # no empty section on success
        return self.fieldsets

    @admin.display(description="export id", ordering="id")
    def short_id(self, obj):
        return admin_display.short_id(obj.pk)

    @admin.display(description="report dates", ordering="start_date")
    def report_dates(self, obj):
        return f"{obj.start_date:%Y-%m-%d} to {obj.end_date:%Y-%m-%d}"

    @admin.display(description="status", ordering="status")
    def status_shown(self, obj):
        """The status, and a running export's progress beside it (one column, not two)."""
        percent = obj.progress_percent if obj.status == ExportStatus.RUNNING else None
        return obj.get_status_display() if percent is None else f"{obj.get_status_display()}, {percent}%"

    @admin.display(description="requested", ordering="created_at")
    def requested(self, obj):
        return admin_display.short_time(obj.created_at)

    @admin.display(description="attempts", ordering="attempt_count")
    def attempts(self, obj):
        return f"{obj.attempt_count} of {obj.attempt_limit}"

    @admin.action(description="Retry selected failed or cancelled exports", permissions=["act"])
    @button("Retry this export")
    @action_role(Role.OPERATOR)
    def retry(self, request, queryset):
        message_results(self, request, export_retry(user=request.user, export_ids=list(queryset.values_list("pk", flat=True))))

    @admin.action(description="Cancel selected exports", permissions=["act"])
    @button("Cancel this export")
    @action_role(Role.OPERATOR)
    def cancel(self, request, queryset):
        message_results(self, request, export_cancel_by(user=request.user, export_ids=list(queryset.values_list("pk", flat=True))))

    def has_act_permission(self, request):
        """Retry and cancel act on work, not on the record's fields: whoever sees exports and holds
        the operator role in an account (each selected export is checked against its account)."""
        return self.has_view_permission(request) and self.has_role(request, Role.OPERATOR)

    @admin.display(description="download")
    def download(self, obj):
        if obj.status != ExportStatus.SUCCEEDED:
            return "—"
        # The API's download view checks membership again and answers with a link that expires.
        return format_html('<a href="{}">download ({} rows)</a>', reverse("exports:download", args=[obj.pk]), obj.row_count)

    @admin.display(description="timings")
    def timings(self, obj):
        waited = (obj.started_at - obj.created_at) if obj.started_at else None
        ran = (obj.completed_at - obj.started_at) if obj.completed_at and obj.started_at else None
        return f"waited {_secs(waited)}, ran {_secs(ran)}"

    @admin.display(description="progress")
    def progress(self, obj):
        percent = obj.progress_percent
        return "—" if percent is None else f"{percent}%"


def _secs(delta) -> str:
    return "—" if delta is None else f"{delta.total_seconds():.1f} s"


@admin.register(ActivityEvent)
class ActivityEventAdmin(AccountScopedAdmin):
    list_display = ["occurred_at", "account", "actor_email", "event_type", "amount"]
    list_filter = ["event_type", "account"]
    date_hierarchy = "occurred_at"
    list_select_related = ["account"]
    show_full_result_count = False


class ExportScheduleForm(forms.ModelForm):
    """The requester must be allowed to export the account (as every export request must)."""

    class Meta:
        model = ExportSchedule
        fields = "__all__"

    def clean(self):
        data = super().clean()
        account, requester = data.get("account"), data.get("requested_by")
        if account is not None and requester is not None and not can_export(user=requester, account=account):
            self.add_error("requested_by", "This person may not export this account's data.")
        return data


@admin.register(ExportSchedule)
class ExportScheduleAdmin(AccountScopedAdmin):
    form = ExportScheduleForm
    write_role = Role.OPERATOR  # recurring exports are work: operators run it
    list_display = ["account", "source", "period", "at_time", "requested_by", "is_active", "created_at"]
    list_filter = ["period", "is_active", "account"]
    actions = ["run_now"]

    @admin.action(description="Run now (request the latest period)")
    @action_role(Role.OPERATOR)
    def run_now(self, request, queryset):
        message_results(self, request, export_schedule_run_now(user=request.user, schedule_ids=list(queryset.values_list("pk", flat=True))))
