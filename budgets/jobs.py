"""Budgets' maintenance job (scheduled in scheduling.schedules)."""
from budgets import services
from scheduling.registry import job


# Named in the kernel's namespace for the schedules and dashboards that already know it.
@job("scheduling.reclaim_leases", account_scoped=False)
def reclaim_leases(ctx) -> None:
    """Give back the slots and reservations of runs whose worker died."""
    ctx.items = services.reclaim_expired()
