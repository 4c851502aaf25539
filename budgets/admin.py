from django.contrib import admin, messages
from django.utils.html import format_html_join

from budgets.models import Account, ApiToken, Budget, Membership, Reservation, UsageDay
from budgets.selectors import budget_status
from budgets.tenancy import AccountScopedAdmin, ReadOnlyAdmin


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

    def changelist_view(self, request, extra_context=None):
        # One query set for the whole page instead of one per row.
        self._status = {}
        for row in budget_status(accounts=self.get_queryset(request)):
            self._status.setdefault(row.account, []).append(row)
        return super().changelist_view(request, extra_context)

    @admin.display(description="today's CPU (used / limit, running, sent, held)")
    def budget_today(self, obj):
        rows = getattr(self, "_status", {}).get(obj.slug, [])
        return format_html_join(
            "", "<div>{}: {} / {} s ({}%), {}/{} running, {} sent, {} held</div>",
            ((r.queue, round(r.cpu_used_ms / 1000, 1), r.cpu_limit_ms // 1000,
              round(100 * r.cpu_used_ms / r.cpu_limit_ms) if r.cpu_limit_ms else 0,
              r.running, r.max_concurrent, r.sent, r.held) for r in rows),
        ) or "—"


@admin.register(Membership)
class MembershipAdmin(AccountScopedAdmin):
    list_display = ["user", "account", "role", "created_at"]
    list_filter = ["role", "account"]
    search_fields = ["user__username", "user__email", "account__slug"]
    autocomplete_fields = ["user", "account"]


@admin.register(Budget)
class BudgetAdmin(AccountScopedAdmin):
    list_display = ["account", "queue", "cpu_seconds_per_day", "max_concurrent"]
    list_filter = ["queue", "account"]


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
