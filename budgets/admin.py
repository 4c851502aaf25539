from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.shortcuts import render
from django.utils.html import format_html, format_html_join

from budgets.adjust import budget_adjust
from budgets.models import Account, ApiToken, Budget, BudgetAdjustment, Membership, Reservation, UsageDay
from budgets.selectors import budget_status
from budgets.tenancy import AccountScopedAdmin, ReadOnlyAdmin
from scheduling.charts import burn_down
from scheduling.operator import message_results
from scheduling.pausing import pause, resume


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


class BudgetInline(admin.TabularInline):
    model = Budget
    extra = 0


@admin.register(Account)
class AccountAdmin(AccountScopedAdmin):
    account_path = "pk"
    list_display = ["slug", "name", "plan", "is_active", "budget_today"]
    list_filter = ["plan", "is_active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline, BudgetInline]
    actions = ["pause_accounts", "resume_accounts"]

    @admin.action(description="Pause: hold the selected accounts' new work")
    def pause_accounts(self, request, queryset):
        message_results(self, request, [pause(user=request.user, account=account) for account in queryset])

    @admin.action(description="Resume: release the selected accounts' paused work")
    def resume_accounts(self, request, queryset):
        message_results(self, request, [resume(user=request.user, account=account) for account in queryset])

    def changelist_view(self, request, extra_context=None):
        # One query set for the whole page instead of one per row.
        self._status = {}
        for row in budget_status(accounts=self.get_queryset(request)):
            self._status.setdefault(row.account, []).append(row)
        return super().changelist_view(request, extra_context)

    @admin.display(description="today's CPU per queue (used, reserved, limit) and work")
    def budget_today(self, obj):
        rows = getattr(self, "_status", {}).get(obj.slug, [])
        return format_html_join(
            "", '<div class="budget-row">{} {} {}: {} / {} s used, {} s reserved; {}/{} running, {} sent, {} held</div>',
            ((burn_down(used=r.cpu_used_ms, reserved=r.cpu_reserved_ms, limit=r.cpu_limit_ms), r.queue,
              f"({round(100 * r.cpu_used_ms / r.cpu_limit_ms) if r.cpu_limit_ms else 0}%)",
              round(r.cpu_used_ms / 1000, 1), r.cpu_limit_ms // 1000, round(r.cpu_reserved_ms / 1000, 1),
              r.running, r.max_concurrent, r.sent, r.held) for r in rows),
        ) or "—"


@admin.register(Membership)
class MembershipAdmin(AccountScopedAdmin):
    list_display = ["user", "account", "role", "created_at"]
    list_filter = ["role", "account"]
    search_fields = ["user__username", "user__email", "account__slug"]
    autocomplete_fields = ["user", "account"]


class AdjustForm(forms.Form):
    cpu_seconds_per_day = forms.IntegerField(min_value=0, label="CPU seconds per day")
    today_only = forms.BooleanField(required=False, initial=True, label="For today only (back at the next budget day)")


@admin.register(Budget)
class BudgetAdmin(AccountScopedAdmin):
    list_display = ["account", "queue", "cpu_seconds_per_day", "max_concurrent"]
    list_filter = ["queue", "account"]
    actions = ["adjust"]

    @admin.action(description="Adjust the daily CPU budget (today only or for good)")
    def adjust(self, request, queryset):
        form = AdjustForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            message_results(self, request, [
                budget_adjust(user=request.user, budget_id=budget.pk, today_only=form.cleaned_data["today_only"],
                              cpu_seconds_per_day=form.cleaned_data["cpu_seconds_per_day"]) for budget in queryset])
            return None
        return render(request, "admin/budgets/adjust.html", {
            **self.admin_site.each_context(request), "title": "Adjust budgets", "form": form, "budgets": queryset,
            "selected": request.POST.getlist(ACTION_CHECKBOX_NAME), "opts": self.model._meta,
        })


@admin.register(BudgetAdjustment)
class BudgetAdjustmentAdmin(ReadOnlyAdmin):
    account_path = "budget__account"
    list_display = ["budget", "previous_cpu_seconds", "cpu_seconds_per_day", "until_day", "ended_at", "adjusted_by",
                    "created_at"]
    list_filter = ["until_day"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ["name", "user", "hint", "created_at", "last_used_at"]
    readonly_fields = ["hint", "created_at", "last_used_at"]
    fields = ["user", "name", "hint", "created_at", "last_used_at"]
    autocomplete_fields = ["user"]

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        return qs if request.user.is_superuser else qs.filter(user=request.user)

    def has_change_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        token, raw = ApiToken.issue(user=obj.user, name=obj.name)
        obj.pk = token.pk
        self.message_user(request, f"Token created. Copy it now, it is not shown again: {raw}", messages.WARNING)


@admin.register(UsageDay)
class UsageDayAdmin(ReadOnlyAdmin):
    list_display = ["day", "account", "queue", "cpu_used_ms", "cpu_reserved_ms", "wall_ms", "db_wait_ms",
                    "storage_wait_ms", "runs", "deferrals", "cap_hits"]
    list_filter = ["queue", "account"]
    date_hierarchy = "day"


@admin.register(Reservation)
class ReservationAdmin(ReadOnlyAdmin):
    list_display = ["job", "ref", "account", "queue", "status", "cpu_reserved_ms", "cpu_reported_ms", "worker",
                    "created_at", "lease_expires_at"]
    list_filter = ["status", "queue", "account"]
