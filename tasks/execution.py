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
from dataclasses import dataclass
from inspect import iscoroutinefunction
from uuid import UUID

from asgiref.sync import sync_to_async
from django.db import close_old_connections
from django_q.exceptions import TimeoutException

from scheduling import db
from scheduling.envelope import ContractError
from scheduling.models import Outcome
from scheduling.retries import MustWait, is_transient
from scheduling.services import task_run_amend_outcome, worker_id
from tasks import calls, payload, results, signals
from tasks.compat import TaskContext
from tasks.models import TaskCall

logger = logging.getLogger("fairshare.tasks")


@dataclass
class Along:
    """A call's claim and completion sent in the round trips of its run's admission and settlement
    (`CallMiddleware`): what the middleware and the handler share (`ctx.state["tasks"]`)."""

    claim: object = None  # the claim's place in scheduling.db's queue, until it is sent
    claimed: calls.Claimed | None = None  # what it claimed, once it was sent
    taken: bool = False  # the handler ran the call it claimed
    task: object = None  # the call's task, once the handler queued its completion
    completed: bool | None = None  # the completion's verdict, once it was sent

    def claimed_along(self, claimed: calls.Claimed | None) -> None:
        self.claim, self.claimed = None, claimed

    def done(self, completed: bool) -> None:
        self.completed = completed


class CallMiddleware:
    """A Django task call's claim and completion, which every call pays for, in the round trips and
    transactions of its run's admission and settlement (scheduling.db.send_along: 2 statements of
    the call's own in 2 round trips with the chain's, instead of 4). Listed above the budget
    middleware (settings.FAIRSHARE["TASK_MIDDLEWARE"]); without it the handler claims and completes
    in statements of their own, as it does when nothing took them along (system work, whose run is
    recorded by the ORM; an admission under the lock, which the claim goes ahead of and so claims
    nothing).

    The claim goes out after the next of Fairshare's statements, the admission, and claims only if
    that recorded this run as started (tasks/queries.sql `claim_along`): a run refused or held leaves
    the call READY. A run admitted that does not run the call (its admission found a pause, its start
    failed) gives it back as it was (`calls.unclaim`). `task_finished` is sent once the settlement
    that took the completion along is committed, and a completion the run no longer held the call
    for (a newer run owns it) makes the run's outcome SKIPPED."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        if ctx.job.handler is not run or ctx.run is None:
            return self.call_next(ctx)
        try:
            call_id = _call_id(ctx)
        except ContractError:
            return self.call_next(ctx)  # the handler rejects it
        along = ctx.state["tasks"] = Along()
        along.claim = calls.claim_along(call_id=call_id, worker=worker_id(), run=ctx.run, then=along.claimed_along)
        try:
            self.call_next(ctx)
        finally:
            if along.claim is not None:
                db.withdraw_along(along.claim)  # nothing took it and the handler did not run: nothing claimed
            if along.claimed is not None and not along.taken:
                calls.unclaim(along.claimed)
            if along.task is not None:
                # A completion no statement took along (no settlement: system work; or the settlement
                # failed): it goes on its own, as the call's result does not depend on the settlement.
                db.flush_along()
        if along.completed:
            signals.finished(along.claimed.call, along.task)
        elif along.completed is False:
            _superseded(ctx, along.claimed)


def _superseded(ctx, claimed: calls.Claimed) -> None:
    """The reconciler took the call from this run (it was thought lost): a newer run owns it."""
    logger.warning("task call superseded", extra={"task_call": str(claimed.call.pk)})
    ctx.outcome = Outcome.SKIPPED
    if ctx.run.outcome != Outcome.RUNNING:  # its settlement recorded how it ended, with the completion
        task_run_amend_outcome(run=ctx.run, outcome=Outcome.SKIPPED)


def run(ctx) -> None:
    """The job handler: the envelope's ref is the call's id."""
    along: Along | None = ctx.state.get("tasks")
    claimed = None
    if along is not None:
        db.flush_along()  # a claim nothing took along yet (system work: its run recorded by the ORM)
        claimed, along.taken = along.claimed, along.claimed is not None
    if claimed is None:
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
    along: Along | None = ctx.state.get("tasks")
    if along is not None and along.taken:  # with the settlement; CallMiddleware goes on once it is committed
        along.claimed, along.task = claimed, task
        calls.complete_along(claimed, value=value, then=along.done)
    elif calls.complete(claimed, value=value):
        signals.finished(claimed.call, task)
    else:
        _superseded(ctx, claimed)


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
