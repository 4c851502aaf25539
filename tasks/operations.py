"""Operator actions on Django task calls: retry a failed one, cancel one that has not run yet.

Each checks the role (operators act on work; a system call, which belongs to no account, only a
superuser), works item by item under the call's row lock, reports per item and writes the admin
log; the admin calls these.
"""
from django.db import transaction

from scheduling import holding
from scheduling.operator import ItemResult, log_action, refusal
from scheduling.registry import get_job
from tasks import calls, routing, services, signals
from tasks.compat import TaskResultStatus as Status
from tasks.models import TaskCall


def call_retry(*, user, call_ids) -> list[ItemResult]:
    """Run failed calls again: same id, as many fresh attempts as the job's retry policy grants,
    their errors kept on record."""
    results_ = []
    for call_id in call_ids:
        with transaction.atomic():
            # Row lock: two operators retrying at once send the call once.
            call = TaskCall.objects.select_for_update().filter(pk=call_id).first()
            why = _refusal(user, call)
            if not why and call.status != Status.FAILED:
                why = f"it is {call.status.lower()}; only failed task calls can be retried"
            if why:
                results_.append(ItemResult(f"task call {call_id}", False, why))
                continue
            job = get_job(routing.job_name(queue=call.queue, system=call.account_id is None))
            calls.retry(call, attempts=job.retry.max_attempts)
            transaction.on_commit(lambda call=call: services.send(call))
            log_action(user=user, obj=call, message="Retried (was failed)")
            results_.append(ItemResult(str(call), True, "queued again"))
    return results_


def call_cancel(*, user, call_ids) -> list[ItemResult]:
    """Cancel calls that have not started: FAILED with a Cancelled error, out of the holding area.
    A running call cannot be stopped from outside (a task function has no checkpoints)."""
    results_ = []
    for call_id in call_ids:
        with transaction.atomic():
            # Row lock: a worker's claim (a guarded UPDATE of READY) waits for it, then finds it failed.
            call = TaskCall.objects.select_for_update().filter(pk=call_id).first()
            why = _refusal(user, call)
            if not why and call.status != Status.READY:
                why = f"it is {call.status.lower()}; only a task call that has not started can be cancelled"
            if why:
                results_.append(ItemResult(f"task call {call_id}", False, why))
                continue
            calls.cancel(call, by=user.get_username())
            holding.unhold(job=routing.job_name(queue=call.queue, system=call.account_id is None), ref=str(call.pk))
            transaction.on_commit(lambda call=call: signals.finished(call))
            log_action(user=user, obj=call, message="Cancelled")
            results_.append(ItemResult(str(call), True, "cancelled"))
    return results_


def _refusal(user, call: TaskCall | None) -> str | None:
    if call is None:
        return "not found"
    return refusal(user=user, account_id=call.account_id, needs="operator")

