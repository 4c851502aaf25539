"""Account scoping: who may act for which account, and the admin bases that show a tenant only
its own records. The lowest layer with budgets.models: every app may import it."""
from django.contrib import admin
from django.db.models import QuerySet

from budgets.models import Account, Membership


def membership_of(*, user, account: Account) -> Membership | None:
    if user is None or not user.is_authenticated:
        return None
    return Membership.objects.filter(user=user, account=account).first()


def can_export(*, user, account: Account) -> bool:
    """Superusers may export any account; others need an exporting role in it."""
    if user is None or not user.is_active:
        return False
    if user.is_superuser:
        return True
    membership = membership_of(user=user, account=account)
    return membership is not None and membership.can_export


def accounts_visible_to(*, user) -> QuerySet[Account]:
    if user.is_superuser:
        return Account.objects.all()
    return Account.objects.filter(memberships__user=user)


class AccountScopedAdmin(admin.ModelAdmin):
    """Staff who are not superusers see only the records of accounts they belong to
    (nothing at all of models with no account, `account_path = None`)."""

    account_path: str | None = "account"

    def get_queryset(self, request):
        qs = super().get_queryset(request)
        if request.user.is_superuser:
            return qs
        if self.account_path is None:
            return qs.none()
        return qs.filter(**{f"{self.account_path}__in": accounts_visible_to(user=request.user)})


class ReadOnlyAdmin(AccountScopedAdmin):
    """For records the system writes (task runs, attempts): inspect, never edit by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser
