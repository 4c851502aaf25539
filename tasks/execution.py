"""How a Django task call runs: the handler of the `tasks.run.<queue>` and `tasks.system.<queue>`
jobs, inside the kernel's task middleware chain (contract, run recording, budget admission and the
CPU hard cap, pause, retries) like every Fairshare job.

The handler claims the call (READY -> RUNNING: tasks/calls.py), sends `task_started`, calls the
function with the stored arguments, stores its return value (SUCCESSFUL) or its error (FAILED) and
sends `task_finished`. Failures keep the kernel's classification: an exception goes on to the retry
middleware, which sends a transient one again after a back-off (the call waits READY, its error on
record) and gives up on the rest (`give_up`: FAILED). A `SystemExit` raised by the task fails the
call and stays there: a task's `exit()` must not end a worker shared by every account. django-q2's
time limit and an interrupt fail the call and go on, so the worker is replaced as for any job.

`async def` tasks run with `asyncio.run`, an event loop of their own on the worker's main thread:
the kernel's time limit and CPU hard cap (signals, delivered to that thread) stop them as they stop
any task; with asgiref's `async_to_sync` the coroutine would run on another thread, out of their
reach. Their ORM calls (`await Model.objects.aget(...)`, `sync_to_async`) run on asgiref's thread,
whose connections are checked when the task ends, as after a request.
"""
import asyncio
import logging
from inspect import iscoroutinefunction
from uuid import UUID

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django_q.exceptions import TimeoutException

from scheduling.envelope import ContractError
from scheduling.models import Outcome
from scheduling.retries import MustWait, is_transient
from scheduling.services import worker_id
from tasks import calls, payload, results, signals
from tasks.compat import TaskContext
from tasks.models import TaskCall

logger = logging.getLogger("fairshare.tasks")


def run(ctx) -> None:
    """The job handler: the envelope's ref is the call's id."""
    claimed = calls.claim(call_id=_call_id(ctx), worker=worker_id(), run_id=ctx.run.pk)
    if claimed is None:  # finished, cancelled, claimed by another delivery, or pruned
        ctx.outcome = Outcome.SKIPPED
        return
    ctx.items = 1
    try:
        task = results.task_of(claimed.call)
    except Exception as exc:  # the code changed since it was sent: nothing to run, ever
        calls.fail(claimed, error=payload.task_error(exc), final=True)
        ctx.outcome, ctx.error = Outcome.FAILED, exc
        return
    _call(ctx, claimed, task)


def _call(ctx, claimed: calls.Claimed, task) -> None:
    try:
        running = results.to_result(claimed.call, task)
        signals.started(running)  # a receiver's failure is the call's
        value = payload.return_value(_invoke(task, claimed.call, running))
    except MustWait:  # e.g. the account's daily CPU ran out: not a failure, the job waits
        calls.give_back(claimed)
        raise
    except Exception as exc:
        # Transient failures wait READY while the retry middleware decides (`give_up` if it will not send
        # the call again); the rest fail here. Either way the retry middleware sees the exception.
        final = not is_transient(exc)
        if calls.fail(claimed, error=payload.task_error(exc), final=final) and final:
            signals.finished(claimed.call, task)
        raise
    except BaseException as exc:
        if calls.fail(claimed, error=payload.task_error(exc), final=True):
            signals.finished(claimed.call, task)
        if isinstance(exc, (TimeoutException, KeyboardInterrupt)):
            raise  # the kernel records it and django-q2 replaces the worker
        ctx.error = exc  # the task's own SystemExit: the run is recorded failed, the worker goes on
        return
    if calls.complete(claimed, value=value):
        signals.finished(claimed.call, task)
    else:  # the reconciler took the call from this run (it was thought lost): a newer run owns it
        logger.warning("task call superseded", extra={"task_call": str(claimed.call.pk)})
        ctx.outcome = Outcome.SKIPPED


def _invoke(task, call: TaskCall, running):
    args = call.arguments["args"]
    if task.takes_context:
        args = [TaskContext(task_result=running), *args]
    kwargs = results.function_kwargs(call, task)
    if iscoroutinefunction(task.func):
        return asyncio.run(_awaited(task.func, args, kwargs))
    return task.func(*args, **kwargs)


async def _awaited(func, args, kwargs):
    try:
        return await func(*args, **kwargs)
    finally:
        await sync_to_async(close_old_connections)()


def give_up(ctx, exc: BaseException) -> None:
    """The job's `on_give_up`: the retry middleware will not send again a call this run left
    READY (a transient failure out of retries, or system work, which is never retried): FAILED."""
    if ctx.run is None or ctx.run.pk is None:
        return
    try:
        call_id = _call_id(ctx)
    except ContractError:
        return
    if calls.give_up(call_id=call_id, run_id=ctx.run.pk):
        signals.finished(TaskCall.objects.get(pk=call_id))


def _call_id(ctx) -> UUID:
    try:
        return UUID(ctx.envelope.ref)
    except ValueError:
        raise ContractError("a tasks job needs a task call id as its ref") from None
