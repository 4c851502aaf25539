"""The tasks app's jobs: the two that carry Django task calls on each queue a Fairshare TASKS
backend lists (tasks/routing.py), made from TASKS at start-up, and its maintenance (scheduled in
scheduling.schedules)."""
from django.conf import settings
from django.utils.module_loading import import_string

from scheduling.registry import job
from tasks import execution, routing
from tasks.backend import FairshareBackend
from tasks.maintenance import prune_results, reconcile_calls


def fairshare_queues() -> list[str]:
    """Every queue a Fairshare backend (or a subclass) lists in TASKS, in order, once."""
    seen: dict[str, None] = {}
    for params in getattr(settings, "TASKS", {}).values():
        try:
            backend = import_string(params["BACKEND"])
        except (ImportError, KeyError):
            continue  # the framework reports a backend it cannot load
        if isinstance(backend, type) and issubclass(backend, FairshareBackend):
            seen.update(dict.fromkeys(params.get("QUEUES", [])))
    return list(seen)


for _queue in fairshare_queues():
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
