"""Sending the Tasks framework's signals for a call: `task_enqueued` (the backend, as it stores
the call), `task_started` and `task_finished` (in the worker, and in whichever process ends a call
without running it: the reconciler for a lost worker, an operator's cancel). The sender is the
backend's class, as the framework's own backends send them."""
import logging

from tasks import results
from tasks.compat import task_enqueued, task_finished, task_started
from tasks.models import TaskCall

logger = logging.getLogger("fairshare.tasks")


def started(result) -> None:
    task_started.send(type(result.task.get_backend()), task_result=result)


def finished(call: TaskCall, task=None) -> None:
    """The call is SUCCESSFUL or FAILED now. Its task may be gone (the code changed since it was
    sent): then the call is finished all the same, only the signal is not sent."""
    try:
        result = results.to_result(call, task)
    except Exception as exc:
        logger.warning("task_finished not sent: the task cannot be loaded",
                       extra={"task_call": str(call.pk), "error_class": type(exc).__name__})
        return
    task_finished.send(type(result.task.get_backend()), task_result=result)


def enqueued(result) -> None:
    task_enqueued.send(type(result.task.get_backend()), task_result=result)
