"""The tasks app's maintenance: repairing what dead workers and lost messages leave behind, and
pruning finished calls.

A call is never left RUNNING for ever: the kernel marks the run of a dead worker lost (the reclaim
of its reservation's lease for an account's run, the sweep of silent workers for system work), and
the reconciler then gives the call back to the queue while it has attempts left, or fails it with a
WorkerLost error. A READY call that nothing holds, sends or runs (a message lost with the Redis
broker, a send that failed after its row committed) is sent again once it is stale.
"""
import datetime as dt
import logging

from django.conf import settings
from django.db.models import Exists, OuterRef
from django.utils import timezone

from budgets.selectors import refs_in_flight
from scheduling.models import DeferredTask, Outcome, TaskRun
from tasks import calls, routing, services, signals
from tasks.compat import TaskResultStatus as Status
from tasks.models import FINISHED, TaskCall

logger = logging.getLogger("fairshare.tasks")

# Calls looked at per reconciler run (the next run, a minute later, takes the rest).
BATCH = 500


def reconcile_calls() -> int:
    """Returns how many calls it touched: lost runs given back or failed, lost messages sent again."""
    return _lost_runs() + _lost_messages()


def _lost_runs() -> int:
    """RUNNING calls whose run is over (the kernel marked it lost, or it ended without finishing
    the call) or gone."""
    alive = TaskRun.objects.filter(pk=OuterRef("run_id"), outcome=Outcome.RUNNING)
    touched = 0
    for call in TaskCall.objects.filter(status=Status.RUNNING).filter(~Exists(alive)).order_by("sent_at")[:BATCH]:
        status = calls.lost(call)
        if status == Status.READY:
            services.send(call)
        elif status == Status.FAILED:
            signals.finished(call)
        if status is not None:
            logger.warning("task call's run was lost", extra={"task_call": str(call.pk), "status": status})
            touched += 1
    return touched


def _lost_messages() -> int:
    """READY calls sent before the stale time that are neither held nor in flight.

    An account's call sent to the broker holds a slot until it starts; if its message is lost, the
    kernel notices when the slot's dispatch lease ends and holds the call again (`message_lost`).
    So an account's call is sent again here only when it has no live slot at all (a send that
    failed after its row committed); a system call, which takes no slot, once it is stale (with
    the Redis broker a killed worker's message is gone). A spare message costs nothing: the claim
    decides what runs."""
    now = timezone.now()
    stale = now - dt.timedelta(seconds=settings.FAIRSHARE["TASKS_STALE_AFTER_S"])
    waiting = list(TaskCall.objects.filter(status=Status.READY, sent_at__lt=stale).order_by("sent_at")[:BATCH])
    if not waiting:
        return 0
    jobs = {routing.job_name(queue=c.queue, system=c.account_id is None) for c in waiting}
    refs = [str(c.pk) for c in waiting]
    busy = set(DeferredTask.objects.filter(job__in=jobs, ref__in=refs).values_list("ref", flat=True))
    any_live_slot = now - dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])
    for job in jobs:
        busy.update(refs_in_flight(job=job, sent_since=any_live_slot).filter(ref__in=refs))
    touched = 0
    for call in waiting:
        if str(call.pk) not in busy and calls.resent(call):
            services.send(call)
            touched += 1
    return touched


def prune_results(*, older_than_days: int, batch: int = 1000) -> int:
    """Delete finished calls (SUCCESSFUL or FAILED) that finished more than `older_than_days` ago,
    in batches; returns how many went."""
    cutoff = timezone.now() - dt.timedelta(days=older_than_days)
    total = 0
    while True:
        ids = list(TaskCall.objects.filter(finished_at__lt=cutoff, status__in=FINISHED)
                   .order_by("finished_at").values_list("pk", flat=True)[:batch])
        if not ids:
            return total
        total += TaskCall.objects.filter(pk__in=ids, status__in=FINISHED).delete()[0]
