"""The one entry point django-q2 runs, and the one way Fairshare enqueues work.

Every job travels as an envelope to `scheduling.runtime.execute`, which runs the task middleware
chain (settings.FAIRSHARE["TASK_MIDDLEWARE"], outermost first) around the job's handler.
Account work passes the enqueue gates (settings.FAIRSHARE["ENQUEUE_GATES"]) before it is sent.
"""
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.db import InterfaceError, OperationalError, connections, transaction
from django.utils.module_loading import import_string
from django_q.tasks import async_task

from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.redaction import LOG_MAX_LENGTH, redact
from scheduling.registry import Job, get_job

RUNNER = "scheduling.runtime.execute"
# django-q2's group of an account's task: its task rows are scoped by it in the admin.
ACCOUNT_GROUP = "account-{}"
T = TypeVar("T")


class UnlimitedBudget:
    """A run's CPU allowance when no middleware sets one: checking it never stops the run."""

    def remaining(self) -> float:
        return math.inf

    def check(self) -> None:
        pass


@dataclass
class TaskContext:
    """What middleware and handlers share about one run."""

    message: Any
    envelope: Envelope | None = None
    job: Job | None = None
    run: TaskRun | None = None
    meter: Meter = field(default_factory=Meter)
    # Set by the handler: how many items it processed, and "skipped" when it had nothing to do.
    items: int = 0
    outcome: str | None = None
    # A failure a middleware handled (e.g. classified for retry) that the run record must show.
    error: BaseException | None = None
    # The run's CPU allowance; long jobs call `budget.check()` between batches. A middleware may
    # set a limited one (budgets.limits.RunBudget raises budgets.limits.BudgetExhausted).
    budget: Any = field(default_factory=UnlimitedBudget)


TaskCall = Callable[[TaskContext], None]


def send(*, job: str, account: int | None, ref: str) -> str:
    """Ring the doorbell: put the envelope in the job's queue, no questions asked. It goes as the
    version FAIRSHARE["ENVELOPE_VERSION"] names (pinned during a rolling upgrade, docs/deploy.md)."""
    spec = get_job(job)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref), v=settings.FAIRSHARE["ENVELOPE_VERSION"])
    return send_message(envelope.to_message(), queue=spec.queue, name=f"{spec.name}:{ref}", account=account)


def send_message(message: Any, *, queue: str, name: str, account: int | None) -> str:
    """Put a message in a queue as it is (a parked message of a newer version goes back unchanged)."""
    group = {"group": ACCOUNT_GROUP.format(account)} if account is not None else {}
    return async_task(RUNNER, message, cluster=queue, task_name=name[:100], **group)


def send_on_commit(*, job: str, account: int | None, ref: str) -> None:
    transaction.on_commit(lambda: send(job=job, account=account, ref=ref))


class EnqueueGate(Protocol):
    """The enqueue-time check, listed in FAIRSHARE["ENQUEUE_GATES"] (dotted paths, instantiated
    once), like Django's AUTHENTICATION_BACKENDS. Gates see account work only.

    `admit` returns True when the job may go to the broker; False when it may not now, in which
    case the gate has put it in the holding area (`scheduling.holding.hold`). `undo` gives back
    what an admission took when the job could not be sent after all. `release_due` sends held
    work whose time has come, as far as the gate allows; the worker pulse and the
    `scheduling.release_deferred` schedule call it. (budgets.gate.BudgetGate is the default.)
    """

    def admit(self, *, envelope: Envelope, queue: str) -> bool: ...

    def undo(self, *, envelope: Envelope, queue: str) -> None: ...

    def release_due(self) -> int: ...


def enqueue_gates() -> tuple[EnqueueGate, ...]:
    return _load_gates(tuple(settings.FAIRSHARE["ENQUEUE_GATES"]))


@functools.cache
def _load_gates(paths: tuple[str, ...]) -> tuple[EnqueueGate, ...]:
    return tuple(import_string(path)() for path in paths)


def enqueue(*, job: str, account: int | None, ref: str) -> str | None:
    """Submit work: account work a gate holds back goes to the holding area instead of the broker
    (returns None); everything else is sent (returns the django-q2 task id)."""
    spec = get_job(job)
    if not spec.account_scoped:
        return send(job=job, account=account, ref=ref)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref))
    admitted: list[EnqueueGate] = []
    for gate in enqueue_gates():
        try:
            ok = gate.admit(envelope=envelope, queue=spec.queue)
        except BaseException:
            _undo(admitted, envelope=envelope, queue=spec.queue)
            raise
        if not ok:  # held by that gate; the gates before it give back what they took
            _undo(admitted, envelope=envelope, queue=spec.queue)
            return None
        admitted.append(gate)
    try:
        return send(job=job, account=account, ref=ref)
    except BaseException:  # the broker refused it: nothing is on its way, so nothing holds a slot
        _undo(admitted, envelope=envelope, queue=spec.queue)
        raise


def _undo(gates: list[EnqueueGate], *, envelope: Envelope, queue: str) -> None:
    for gate in reversed(gates):
        gate.undo(envelope=envelope, queue=queue)


def enqueue_on_commit(*, job: str, account: int | None, ref: str) -> None:
    # Enqueue only once the rows the job will load are visible to other connections.
    get_job(job)  # fail fast, in the caller, on an unknown job name
    transaction.on_commit(lambda: enqueue(job=job, account=account, ref=ref))


def close_old_connections() -> None:
    """Close this thread's connections that died or were left unusable; keep healthy ones.

    Not Django's `close_old_connections()`: that also closes connections past CONN_MAX_AGE
    (with 0, every one, so a worker paid for a new database connection on every task); and inside
    a caller's transaction (django-q2 `sync` mode, a test, an on-commit callback run inside an outer
    atomic block) it would close the connection under its caller. A worker between tasks is never
    inside one, and a connection that saw an error is checked and replaced only if it is dead.
    """
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
            conn.close()
        elif conn.errors_occurred:
            if conn.is_usable():
                conn.errors_occurred = False
            else:
                conn.close()


# Writes that must land after the work is done (settlement, the run's record): tries, and the
# pause before the n-th retry (n x this).
RECONNECT_ATTEMPTS = 5
RECONNECT_DELAY_S = 0.5


def retry_on_disconnect(write: Callable[[], T]) -> T:
    """Run `write`, reconnecting and trying again when the database connection dropped (a
    failover, a proxy restart, `pg_terminate_backend`): the classic transient failure, and the
    work it would lose is already done. `write` must be one transaction, safe to run again."""
    for attempt in range(1, RECONNECT_ATTEMPTS + 1):
        try:
            return write()
        except (OperationalError, InterfaceError):
            if attempt == RECONNECT_ATTEMPTS:
                raise
            close_old_connections()
            time.sleep(RECONNECT_DELAY_S * attempt)


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
    """The django-q2 task function: takes the envelope as its only argument."""
    _chain()(TaskContext(message=message))
