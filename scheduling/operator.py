"""What every operator action shares: the role it needs, its per-item result, its admin log entry.

Roles (SPEC §3): viewers see; operators act on work (retry, cancel, release, run now, pause);
owners also manage budgets. Superusers may do everything, including what belongs to no account
(a whole queue, django-q2's own schedules). Each action is a service (keyword-only, its own
transaction per item, a row lock naming its race) that the admin, a command or the API calls.
"""
from dataclasses import dataclass

from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType

from budgets.models import Membership, Role

_RANK = {Role.VIEWER: 0, Role.OPERATOR: 1, Role.OWNER: 2}


@dataclass(frozen=True)
class ItemResult:
    """One item's outcome: `ok`, and what happened or why not, in words an operator reads."""

    item: str
    ok: bool
    message: str
    # Why not, for API clients ("not_found", "not_allowed", or the action's own); "" when ok.
    code: str = ""

    def __str__(self) -> str:
        return f"{self.item}: {self.message}"


def role_of(*, user, account_id: int | None) -> str | None:
    if user is None or not user.is_authenticated or not user.is_active or account_id is None:
        return None
    return Membership.objects.filter(user=user, account_id=account_id).values_list("role", flat=True).first()


def refusal(*, user, account_id: int | None, needs: str) -> str | None:
    """None when `user` may act with role `needs` for the account (None: no account, superusers
    only); otherwise why not. Not a member reads as not found, as in the admin (a 404)."""
    if user is not None and user.is_active and user.is_superuser:
        return None
    if account_id is None:
        return "only a superuser may do this"
    role = role_of(user=user, account_id=account_id)
    if role is None:
        return "not found"
    if _RANK[role] < _RANK[needs]:
        return f"your role ({role}) may not do this; it needs {needs}"
    return None


def log_action(*, user, obj, message: str) -> None:
    """Write the action to Django's admin log ("Recent actions", the object's history)."""
    if user is None or not user.is_authenticated:
        return
    LogEntry.objects.create(
        user_id=user.pk, content_type=ContentType.objects.get_for_model(obj, for_concrete_model=False),
        object_id=str(obj.pk), object_repr=str(obj)[:200], action_flag=CHANGE, change_message=message,
    )


def message_results(modeladmin, request, results: list[ItemResult]) -> None:
    """Report each item of an admin action: successes as such, refusals with their reason."""
    from django.contrib import messages  # admin-only helper; the services above need no messages

    for result in results:
        modeladmin.message_user(request, str(result), messages.SUCCESS if result.ok else messages.ERROR)
