"""Budgets' maintenance job (scheduled in scheduling.schedules)."""
from budgets import adjust, reclaim
from scheduling.registry import job


# Named in the kernel's namespace for the schedules and dashboards that already know it.
@job("scheduling.reclaim_leases", account_scoped=False)
def reclaim_leases(ctx) -> None:
    """Give back the slots and reservations of runs whose worker died."""
    ctx.items = reclaim.reclaim_expired()


@job("budgets.end_adjustments", account_scoped=False)
def end_adjustments(ctx) -> None:
    """Put back budgets that were adjusted for one day only, once that day is over."""
    ctx.items = adjust.end_adjustments()
