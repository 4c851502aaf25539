from django.contrib import admin, messages

from budgets.models import Account, ApiToken, Budget, Membership
from budgets.selectors import accounts_visible_to


class AccountScopedAdmin(admin.ModelAdmin):
    """Staff who are not superusers see only the records of accounts they belong to."""

    account_path = "account"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        return qs.filter(**{f"{self.account_path}__in": accounts_visible_to(user=request.user)})


class ReadOnlyAdmin(AccountScopedAdmin):
    """For records the system writes (task runs, attempts): inspect, never edit by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


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
    list_display = ["slug", "name", "plan", "is_active", "created_at"]
    list_filter = ["plan", "is_active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [MembershipInline, BudgetInline]


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
