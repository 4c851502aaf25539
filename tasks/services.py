"""Writes of the tasks app that start work: storing a call and ringing its doorbell.

(Its state transitions are tasks/calls.py; the operators' actions tasks/operations.py.)
"""
import contextlib

from django.db import transaction
from django.utils import timezone

from scheduling.registry import get_job
from scheduling.runtime import _commits_with_the_broker, enqueue
from tasks import accounts, routing, statements
from tasks.models import TaskCall


def call_enqueue(*, backend: str, task, account_id: int | None, arguments: dict) -> TaskCall:
    """Store a call (READY) and send it through the kernel: the account's work passes its enqueue
    gates (budget, cap, pause; a call they hold waits in the holding area, READY all the same).

    With the ORM broker and no transaction open, the call's row, what the gates write and the
    message are one transaction: nothing is half-enqueued. Inside a caller's transaction (or with
    Redis, whose messages cannot join one) the message goes once the row is committed, so a worker
    always finds the call it is sent; a send that fails then leaves the call READY for the
    reconciler to send again (tasks/maintenance.py).
    """
    now = timezone.now()
    job = routing.job_name(queue=task.queue_name, system=account_id is None)
    call = TaskCall(
        backend=backend, task_path=task.module_path, account_id=account_id, queue=task.queue_name,
        priority=task.priority, run_after=task.run_after, arguments=arguments, enqueued_at=now, sent_at=now,
        attempt_limit=get_job(job).retry.max_attempts,
    )
    together = _commits_with_the_broker()  # the kernel's own rule (scheduling.runtime)
    caller_transaction = transaction.get_connection().in_atomic_block
    with contextlib.nullcontext() if caller_transaction else transaction.atomic():
        if not statements.insert(call):
            if caller_transaction:  # no rollback of ours will take the row: it goes now
                TaskCall.objects.filter(pk=call.pk).delete()
            raise accounts.refused(account_id)
        if together:
            send(call)
        else:
            transaction.on_commit(lambda: send(call))
    return call


def send(call: TaskCall) -> str | None:
    """Ring the call's doorbell: the kernel's envelope names only the call (its id is the ref) and
    carries its priority (the order of its account's held work); a `run_after` still to come holds
    it in the holding area ("scheduled") until then. Returns the django-q2 task id, or None when it
    was held."""
    return enqueue(job=routing.job_name(queue=call.queue, system=call.account_id is None), account=call.account_id,
                   ref=str(call.pk), priority=call.priority, run_after=call.run_after)
