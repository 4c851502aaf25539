from django import forms
from django.contrib import admin, messages

from budgets.models import Role
from budgets.tenancy import AccountScopedAdmin, ReadOnlyAdmin, action_role, can_export
from exports.leases import export_cancel
from exports.models import ActivityEvent, ExportAttempt, ExportRecord, ExportSchedule


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
class ExportRecordAdmin(ReadOnlyAdmin):
    list_display = ["id", "account", "source", "start_date", "end_date", "status", "progress",
                    "attempt_count", "row_count", "created_at"]
    list_filter = ["status", "account", "source"]
    search_fields = ["id", "idempotency_key", "account__slug"]
    date_hierarchy = "created_at"
    list_select_related = ["account"]
    inlines = [ExportAttemptInline]
    actions = ["cancel"]
    fieldsets = [
        (None, {"fields": ["id", "account", "requested_by", "source", "format", "start_date", "end_date",
                           "idempotency_key", "status", "progress"]}),
        ("Result", {"fields": ["output_key", "row_count", "byte_size", "checksum_sha256", "completed_at", "expires_at"]}),
        ("Failure", {"fields": ["error_class", "error_message"]}),
        ("Attempts and lease", {"fields": ["attempt_count", "attempt_limit", "lease_owner", "lease_epoch",
                                           "lease_expires_at", "rows_written", "rows_estimated", "created_at",
                                           "started_at"], "classes": ["collapse"]}),
    ]

    @admin.action(description="Cancel selected exports", permissions=["cancel"])
    @action_role(Role.OPERATOR)
    def cancel(self, request, queryset):
        for record in queryset:
            status = export_cancel(export_id=record.pk)
            self.log_change(request, record, f"Cancel requested: {status}")
            self.message_user(request, f"{record.pk}: {status}"
                              + (" (stops at its next batch)" if status == "running" else ""), messages.INFO)

    def has_cancel_permission(self, request):
        return request.user.has_perm("exports.change_exportrecord") and self.has_role(request, Role.OPERATOR)

    @admin.display(description="progress")
    def progress(self, obj):
        percent = obj.progress_percent
        return "—" if percent is None else f"{percent}%"


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
