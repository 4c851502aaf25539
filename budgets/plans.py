"""Plan tiers: the budget every account gets on each queue from its plan (FAIRSHARE["PLAN_BUDGETS"],
budgets/conf.py), until an operator changes it."""
from django.conf import settings
from django.db import transaction

from budgets.models import Account, Budget


@transaction.atomic
def budgets_ensure_defaults(*, account: Account) -> int:
    """Give the account its plan tier's budget on every queue it has none for; returns how many."""
    created = 0
    for queue, limits in settings.FAIRSHARE["PLAN_BUDGETS"][account.plan].items():
        # get_or_create relies on the (account, queue) unique constraint under concurrency.
        _, was_created = Budget.objects.get_or_create(account=account, queue=queue, defaults=limits)
        created += was_created
    return created
