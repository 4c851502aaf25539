"""The one entry point django-q2 runs, and the one way Fairshare enqueues work.

Every job travels as an envelope to `scheduling.runtime.execute`, which runs the task middleware
chain (settings.FAIRSHARE["TASK_MIDDLEWARE"], outermost first) around the job's handler, and then
goes on with held work it is given (work conservation). Account work passes the enqueue gates
(settings.FAIRSHARE["ENQUEUE_GATES"], scheduling.gates) before it is sent.
"""
import contextlib
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, transaction
from django.utils.module_loading import import_string

from scheduling import clock, connections
from scheduling.broker import RUNNER, send
from scheduling.context import Handoff, TaskContext
from scheduling.envelope import Envelope, check_priority
from scheduling.faults import fault_point
from scheduling.gates import EnqueueGate, enqueue_gates
from scheduling.holding import hold_scheduled
from scheduling.redaction import LOG_MAX_LENGTH, redact
from scheduling.registry import get_job
from scheduling.services import worker_id

__all__ = ["RUNNER", "enqueue", "enqueue_many", "enqueue_on_commit", "execute"]
logger = logging.getLogger("fairshare.tasks")
TaskCall = Callable[[TaskContext], None]


def enqueue(*, job: str, account: int | None, ref: str, priority: int | None = None,
            run_after: dt.datetime | None = None) -> str | None:
    """Submit work: account work a gate holds back goes to the holding area instead of the broker
    (returns None); everything else is sent (returns the django-q2 task id). With the ORM broker,
    what the gates wrote and the message commit together (`_commits_with_the_broker`).

    `priority` (-100 to 100, higher first; default: the job's, `@job(priority=)`) orders the
    account's held work; between accounts, the weighted fair share decides. Work with a `run_after` in the future waits in the holding area until then
    ("scheduled"), taking no slot and no place in the broker, and then goes as any held work."""
    spec = get_job(job)
    priority = spec.priority if priority is None else check_priority(priority)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref), priority=priority)
    if run_after is not None and run_after > clock.now():
        hold_scheduled(envelope=envelope, queue=spec.queue, run_after=run_after)
        return None
    if not spec.account_scoped:
        return send(job=job, account=account, ref=ref, priority=priority)
    admitted: list[EnqueueGate] = []
    try:
        with transaction.atomic() if _commits_with_the_broker() else contextlib.nullcontext():
            for gate in enqueue_gates():
                if not gate.admit(envelope=envelope, queue=spec.queue):
                    # Held by that gate; the gates before it give back what they took.
                    _undo(admitted, envelope=envelope, queue=spec.queue)
                    return None
                admitted.append(gate)
            fault_point("before_send")
            return send(job=job, account=account, ref=ref, priority=priority)
    except BaseException:  # a gate failed or the broker refused it: nothing is on its way
        _undo(admitted, envelope=envelope, queue=spec.queue)
        raise


def enqueue_many(*, job: str, work: Iterable[tuple[int | None, str]], priority: int | None = None) -> list[str | None]:
    """Submit a batch of one job's work, `(account, ref)` pairs, all of one `priority` (default: the
    job's): `enqueue` for a flood.

    Gates that offer `admit_many` decide the batch in a few statements (the budget gate: one
    transaction per account that sends what fits its free slots and holds the rest with one
    insert); the others see each job. Returns, per pair in order, the django-q2 task id, or None
    for a job held back. With the ORM broker the whole batch commits at once
    (`_commits_with_the_broker`): a failure sends and holds none of it. Meant for new work: a job
    already dispatched should be sent with `enqueue`.
    """
    spec = get_job(job)
    priority = spec.priority if priority is None else check_priority(priority)
    envelopes = [Envelope(job=spec.name, account=account, ref=str(ref), priority=priority) for account, ref in work]
    verdicts = [True] * len(envelopes)
    admitted: list[EnqueueGate] = []
    sent: list[str | None] = []
    together = _commits_with_the_broker()
    try:
        with transaction.atomic() if together else contextlib.nullcontext():
            for gate in enqueue_gates() if spec.account_scoped else ():
                pending = [i for i, ok in enumerate(verdicts) if ok]
                batch = [envelopes[i] for i in pending]
                oks = gate.admit_many(envelopes=batch, queue=spec.queue)
                for i, ok in zip(pending, oks):
                    if not ok:  # held by that gate; the gates before it give back what they took
                        verdicts[i] = False
                        _undo(admitted, envelope=envelopes[i], queue=spec.queue)
                admitted.append(gate)
            for envelope, ok in zip(envelopes, verdicts):
                sent.append(send(job=job, account=envelope.account, ref=envelope.ref, priority=priority) if ok else None)
    except BaseException:
        # What is not on its way gives its slots back: with the broker in the same transaction,
        # nothing is (its rollback took the messages too); else what was not sent yet.
        for i in range(0 if together else len(sent), len(envelopes)):
            if verdicts[i]:
                _undo(admitted, envelope=envelopes[i], queue=spec.queue)
        raise
    return sent


def _commits_with_the_broker() -> bool:
    """Whether an enqueue's gate writes (its dispatched slot) and its message can be one
    transaction: django-q2's ORM broker keeps its messages on this thread's default connection, and
    no transaction is open on it (in a caller's they already commit with it; a Redis message
    cannot join one). Then an enqueue commits once instead of twice, and a job never holds a slot
    without its message (a producer that died in between left the slot taken until its dispatch
    lease ran out)."""
    from django_q.conf import Conf

    return Conf.ORM == DEFAULT_DB_ALIAS and not transaction.get_connection().in_atomic_block


def _undo(gates: list[EnqueueGate], *, envelope: Envelope, queue: str) -> None:
    for gate in reversed(gates):
        gate.undo(envelope=envelope, queue=queue)


def enqueue_on_commit(*, job: str, account: int | None, ref: str, priority: int | None = None,
                      run_after: dt.datetime | None = None) -> None:
    # Enqueue only once the rows the job will load are visible to other connections.
    get_job(job)  # fail fast, in the caller, on an unknown job name or priority
    if priority is not None:
        check_priority(priority)
    transaction.on_commit(lambda: enqueue(job=job, account=account, ref=ref, priority=priority, run_after=run_after))


def _call_handler(ctx: TaskContext) -> None:
    ctx.job.handler(ctx)


@functools.cache
def _chain() -> TaskCall:
    call: TaskCall = _call_handler
    for path in reversed(settings.FAIRSHARE["TASK_MIDDLEWARE"]):
        call = import_string(path)(call)
    return call


def redact_failed_result(sender, task: dict, **kwargs) -> None:
    """django-q2's post_execute_in_worker signal: a failed task's result is its exception text
    and traceback, which django-q2 stores (Failure) and logs. Redacted before it leaves the worker,
    whatever raised it (the task middleware already lets no raw text through; this is the net)."""
    if not task.get("success") and isinstance(task.get("result"), str):
        task["result"] = redact(task["result"], max_length=LOG_MAX_LENGTH)


def execute(message: Any) -> None:
    """The django-q2 task function: takes the envelope as its only argument.

    Work conservation: after the run, this worker goes on with held work it is given without a
    broker round trip: the job its run's settlement handed its slot on to (the same account's
    next), else one it pulls (another account's, in fair order, into a free slot), each from the
    enqueue gates (`next_for`). Bounded in time (`_handoff_window_s`, well under the queue's
    `timeout` and `retry`: django-q2 acknowledges the message, and its timeout watches the
    process, only once this returns) and in count (FAIRSHARE["HANDOFF_MAX_RUNS"]). A claim this
    worker does not get to run (it died) expires and the job is released again.
    """
    fault_point("before_run")
    deadline, runs_left = time.monotonic() + _handoff_window_s(), settings.FAIRSHARE["HANDOFF_MAX_RUNS"]

    def room() -> bool:
        return runs_left > 0 and time.monotonic() < deadline

    connections.trust_quiet_connection()  # django-q2 just asked for a health check before the task's first query
    ctx = TaskContext(message=message, may_run_next=room)
    _chain()(ctx)
    while (claimed := _next_for(ctx)) is not None:
        fault_point("before_handoff")
        runs_left -= 1
        ctx = TaskContext(message=claimed.envelope.to_message(), claimed_by=worker_id(), run=claimed.run,
                          admission=claimed.admission, may_run_next=room)
        _chain()(ctx)


def _next_for(after: TaskContext) -> Handoff | None:
    """The held job this worker runs next, from the enqueue gates; None when there is none (or the
    database is away)."""
    if after.job is None:
        return None
    try:
        for gate in enqueue_gates():
            claimed = gate.next_for(queue=after.job.queue, worker=worker_id(), after=after)
            if claimed is not None:
                return claimed
    except Exception as exc:  # e.g. the database went away: the message's own work is done; stop
        # here (raising would make django-q2 count the message as failed and deliver it again).
        logger.warning("pulling held work failed", extra={"error_class": type(exc).__name__})
        connections.close_old_connections()
    return None


def _handoff_window_s() -> float:
    """FAIRSHARE["HANDOFF_WINDOW_S"], at most a tenth of this cluster's `timeout`: django-q2 times
    the whole loop as one task, and a run started late in it must not meet the timeout."""
    from django_q.conf import Conf

    window = settings.FAIRSHARE["HANDOFF_WINDOW_S"]
    return min(window, Conf.TIMEOUT / 10) if Conf.TIMEOUT else window
