"""Maintenance jobs (scheduled in scheduling.schedules). Each reports how many items it touched.

`scheduling.reclaim_leases` is declared by budgets (budgets/jobs.py), which owns the leases."""
from django.conf import settings

from scheduling import holding, services
from scheduling.registry import job


@job("scheduling.release_deferred", account_scoped=False)
def release_deferred(ctx) -> None:
    """Release held jobs that are due (back-off over, new budget day) as far as the enqueue gates
    allow (the budget gate: into free slots)."""
    ctx.items = holding.release_due()


@job("scheduling.sweep_lost_runs", account_scoped=False)
def sweep_lost_runs(ctx) -> None:
    """Mark runs lost whose worker died where no lease covers them (see services.task_runs_sweep_lost)."""
    ctx.items = services.task_runs_sweep_lost()


@job("scheduling.rollup_task_runs", account_scoped=False)
def rollup_task_runs(ctx) -> None:
    """Fold old task runs into daily aggregates and prune them."""
    ctx.items = services.rollup_task_runs(older_than_days=settings.FAIRSHARE["TASK_RUN_RETENTION_DAYS"])


@job("scheduling.prune_django_q", account_scoped=False)
def prune_django_q(ctx) -> None:
    """Prune django-q2's own task rows and stale worker heartbeats."""
    ctx.items = services.prune_django_q(older_than_days=settings.FAIRSHARE["DJANGO_Q_RETENTION_DAYS"])


@job("scheduling.noop", queue="default", account_scoped=True, cpu_estimate_ms=5)
def noop(ctx) -> None:
    """Does nothing, through the whole runner and middleware chain (admission, metering,
    settlement): the small job of the capacity rehearsal (`manage.py rehearse --small-jobs`),
    standing in for the cheap tasks that share the default queue with real work, and the chain
    path of bench/budget_overhead.py. The one no-op job (tests register it as "tests.noop")."""
    ctx.items = 1
