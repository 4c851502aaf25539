"""Maintenance jobs (scheduled in scheduling.schedules)."""
from budgets import services as budget_services
from scheduling.registry import job


@job("scheduling.release_deferred", account_scoped=False)
def release_deferred(ctx) -> None:
    """Release held jobs that are due (back-off over, new budget day) into free slots."""
    ctx.items = budget_services.release_due()


@job("scheduling.reclaim_leases", account_scoped=False)
def reclaim_leases(ctx) -> None:
    """Give back the slots and reservations of runs whose worker died."""
    ctx.items = budget_services.reclaim_expired()
