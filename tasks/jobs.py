"""The tasks app's jobs: the two that carry Django task calls on each queue a Fairshare TASKS
backend lists (tasks/routing.py), made from TASKS at start-up, and its maintenance (scheduled in
scheduling.schedules)."""
from django.conf import settings

from scheduling.registry import job
from tasks import execution, routing
from tasks.maintenance import prune_results, reconcile_calls

for _queue in routing.queues():
    job(routing.job_name(queue=_queue, system=False), queue=_queue, on_give_up=execution.give_up)(execution.run)
    job(routing.job_name(queue=_queue, system=True), queue=_queue, account_scoped=False,
        on_give_up=execution.give_up)(execution.run)


@job("tasks.reconcile", account_scoped=False)
def reconcile(ctx) -> None:
    """Task calls whose run was lost (its worker died) or whose message was: sent again, or failed."""
    ctx.items = reconcile_calls()


@job("tasks.prune_results", account_scoped=False)
def prune(ctx) -> None:
    """Delete finished task calls past their retention."""
    ctx.items = prune_results(older_than_days=settings.FAIRSHARE["TASKS_RESULT_RETENTION_DAYS"])
