"""Adjusting an account's daily CPU budget on a queue: for today only, or for good."""
from django.db import transaction
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, BudgetAdjustment
from scheduling.holding import unblock
from scheduling.operator import ItemResult, log_action, refusal


def budget_adjust(*, user, budget_id: int, cpu_seconds_per_day: int, today_only: bool) -> ItemResult:
    """Set the budget's daily CPU seconds. Owners manage budgets (operators may not). Today only:
    the limit goes back to what it was when this budget day ends."""
    with transaction.atomic():
        # Row lock on the Budget: admission reads the limit under this same lock (budgets.standing),
        # so a run is admitted against the old limit or the new one, and two adjustments racing
        # cannot both record the same previous value.
        budget = Budget.objects.select_for_update().select_related("account").filter(pk=budget_id).first()
        why = "not found" if budget is None else refusal(user=user, account_id=budget.account_id, needs="owner")
        if why:
            return ItemResult(f"budget {budget_id}", False, why)
        if cpu_seconds_per_day < 0:
            return ItemResult(str(budget), False, "the limit cannot be negative")
        open_day = budget.adjustments.filter(until_day__isnull=False, ended_at__isnull=True).first()
        previous = budget.cpu_seconds_per_day
        if open_day is not None:
            # A newer change replaces today's: today only keeps the original to go back to; for
            # good means there is nothing to go back to.
            BudgetAdjustment.objects.filter(pk=open_day.pk).update(ended_at=timezone.now())
            if today_only:
                previous = open_day.previous_cpu_seconds
        day = clock.budget_day() if today_only else None
        BudgetAdjustment.objects.create(budget=budget, cpu_seconds_per_day=cpu_seconds_per_day,
                                        previous_cpu_seconds=previous, until_day=day, adjusted_by=user)
        Budget.objects.filter(pk=budget.pk).update(cpu_seconds_per_day=cpu_seconds_per_day)
        if cpu_seconds_per_day > budget.cpu_seconds_per_day:
            # Its line may have waited for the next budget day: it may go now (the pulse releases it).
            unblock(account_id=budget.account_id, queue=budget.queue)
        scope = f"for {day} only (then {previous} s)" if today_only else "for good"
        log_action(user=user, obj=budget, message=f"CPU budget {budget.cpu_seconds_per_day} -> {cpu_seconds_per_day} s/day {scope}")
    return ItemResult(str(budget), True, f"{cpu_seconds_per_day} CPU s/day {scope}")


def end_adjustments() -> int:
    """Put back the limits of today-only adjustments whose budget day is over; returns how many."""
    ended = 0
    with transaction.atomic():
        # SKIP LOCKED: two schedulers firing together put each limit back once.
        due = BudgetAdjustment.objects.select_for_update(skip_locked=True).filter(
            until_day__lt=clock.budget_day(), ended_at__isnull=True)
        for adjustment in due:
            Budget.objects.filter(pk=adjustment.budget_id).update(cpu_seconds_per_day=adjustment.previous_cpu_seconds)
            BudgetAdjustment.objects.filter(pk=adjustment.pk).update(ended_at=timezone.now())
            ended += 1
    return ended
