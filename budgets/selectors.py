"""Reads of the budgets app shared by the admin, the API and the jobs."""
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
