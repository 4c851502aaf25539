"""The one entry point django-q2 runs, and the one way Fairshare enqueues work.

Every job travels as an envelope to `scheduling.runtime.execute`, which runs the task middleware
chain (settings.FAIRSHARE["TASK_MIDDLEWARE"], outermost first) around the job's handler.
Account work passes the enqueue gates (settings.FAIRSHARE["ENQUEUE_GATES"]) before it is sent.
"""
import contextlib
import datetime as dt
import functools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, InterfaceError, OperationalError, connections, transaction
from django.utils.module_loading import import_string
from django_q.tasks import async_task

from scheduling import clock, db
from scheduling.envelope import Envelope, check_priority
from scheduling.faults import fault_point
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
    # Set by a middleware that recorded how the run ended (outcome, items, error) in its own write
    # (budget settlement): the run recording then writes nothing more, unless a failure got past it.
    recorded: bool = False
    # The run's CPU allowance; long jobs call `budget.check()` between batches. A middleware may
    # set a limited one (budgets.limits.RunBudget raises budgets.limits.BudgetExhausted).
    budget: Any = field(default_factory=UnlimitedBudget)
    # Work conservation (see `execute`): `claim` is the worker that claimed this job from the holding
    # area (hand-off or pull; admission completes the claim); a middleware that frees a slot may set
    # `handoff` to a held job it claimed for this worker while `accepts_handoff()` says it runs it next.
    # `admission`: what the admitting middleware did ahead for a handed-off job (Handoff.admission).
    claim: str | None = None
    handoff: "Handoff | None" = None
    admission: Any = None
    accepts_handoff: Callable[[], bool] = lambda: False
    may_pull: bool = True  # False: a middleware saw no held work of the queue waiting (no pull after)
    paused: bool | None = None  # False: a middleware saw no pause covering the job at the run's start


TaskCall = Callable[[TaskContext], None]


@dataclass(frozen=True)
class Handoff:
    """A held job claimed for this worker to run next, and what was done for it ahead: its run's
    record, inserted (`run`), and the admitting middleware's `admission`, when the middleware that
    handed it off admitted it already (budgets' settlement does, in its own transaction)."""

    envelope: Envelope
    run: TaskRun | None = None
    admission: Any = None


def send(*, job: str, account: int | None, ref: str, priority: int = 0) -> str:
    """Ring the doorbell: put the envelope in the job's queue, no questions asked. It goes as the
    version FAIRSHARE["ENVELOPE_VERSION"] names (pinned during a rolling upgrade, docs/deploy.md)."""
    spec = get_job(job)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref), v=settings.FAIRSHARE["ENVELOPE_VERSION"],
                        priority=priority)
    return send_message(envelope.to_message(), queue=spec.queue, name=f"{spec.name}:{ref}", account=account)


def send_message(message: Any, *, queue: str, name: str, account: int | None) -> str:
    """Put a message in a queue as it is (a parked message of a newer version goes back unchanged)."""
    group = {"group": ACCOUNT_GROUP.format(account)} if account is not None else {}
    return async_task(RUNNER, message, cluster=queue, task_name=name[:100], **group)


def send_on_commit(*, job: str, account: int | None, ref: str, priority: int = 0) -> None:
    transaction.on_commit(lambda: send(job=job, account=account, ref=ref, priority=priority))


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

    def admit_many(self, *, envelopes: list[Envelope], queue: str) -> list[bool]:
        """`admit` for a batch (`enqueue_many`), one verdict per envelope in order. Optional."""

    def next_for(self, *, queue: str, worker: str) -> "Handoff | None":
        """Pull: claim one eligible held job of the queue for `worker`, which runs it at once (in
        the gate's fair order, into a free slot only); None when there is none. Optional."""


def enqueue_gates() -> tuple[EnqueueGate, ...]:
    return _load_gates(tuple(settings.FAIRSHARE["ENQUEUE_GATES"]))


@functools.cache
def _load_gates(paths: tuple[str, ...]) -> tuple[EnqueueGate, ...]:
    return tuple(import_string(path)() for path in paths)


def enqueue(*, job: str, account: int | None, ref: str, priority: int = 0,
            run_after: dt.datetime | None = None) -> str | None:
    """Submit work: account work a gate holds back goes to the holding area instead of the broker
    (returns None); everything else is sent (returns the django-q2 task id). With the ORM broker,
    what the gates wrote and the message commit together (`_commits_with_the_broker`).

    `priority` (-100 to 100, higher first) orders the account's held work; between accounts,
    fairness decides. Work with a `run_after` in the future waits in the holding area until then
    ("scheduled"), taking no slot and no place in the broker, and then goes as any held work."""
    spec = get_job(job)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref), priority=check_priority(priority))
    if run_after is not None and run_after > clock.now():
        from scheduling.holding import hold_scheduled

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


def enqueue_many(*, job: str, work: Iterable[tuple[int | None, str]], priority: int = 0) -> list[str | None]:
    """Submit a batch of one job's work, `(account, ref)` pairs, all of one `priority`: `enqueue`
    for a flood.

    Gates that offer `admit_many` decide the batch in a few statements (the budget gate: one
    transaction per account that sends what fits its free slots and holds the rest with one
    insert); the others see each job. Returns, per pair in order, the django-q2 task id, or None
    for a job held back. With the ORM broker the whole batch commits at once
    (`_commits_with_the_broker`): a failure sends and holds none of it. Meant for new work: a job
    already dispatched should be sent with `enqueue`.
    """
    spec = get_job(job)
    check_priority(priority)
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
                admit_many = getattr(gate, "admit_many", None)
                oks = (admit_many(envelopes=batch, queue=spec.queue) if admit_many is not None
                       else [gate.admit(envelope=e, queue=spec.queue) for e in batch])
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


def enqueue_on_commit(*, job: str, account: int | None, ref: str, priority: int = 0,
                      run_after: dt.datetime | None = None) -> None:
    # Enqueue only once the rows the job will load are visible to other connections.
    get_job(job)  # fail fast, in the caller, on an unknown job name or priority
    check_priority(priority)
    transaction.on_commit(lambda: enqueue(job=job, account=account, ref=ref, priority=priority, run_after=run_after))


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


# Writes that must land after the work is done (settlement, the run's record): tries, and the pause
# before the n-th retry (n x this).
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
    """The django-q2 task function: takes the envelope as its only argument.

    Work conservation: after the run, this worker goes on with held work it claimed without a
    broker round trip: the job its run's settlement handed off to it (the same account's next,
    into the slot just freed), else one it pulls from the gates (another account's, in fair
    order, into a free slot). Bounded in time (`_handoff_window_s`, well under the queue's
    `timeout` and `retry`: django-q2 acknowledges the message, and its timeout watches the
    process, only once this returns) and in count (FAIRSHARE["HANDOFF_MAX_RUNS"]). A claim this
    worker does not get to run (it died) expires and the job is released again.
    """
    from scheduling.holding import claim_next
    from scheduling.services import worker_id

    deadline, runs_left = time.monotonic() + _handoff_window_s(), settings.FAIRSHARE["HANDOFF_MAX_RUNS"]

    def room() -> bool:
        return runs_left > 0 and time.monotonic() < deadline

    db.trust_quiet_connection()  # django-q2 just asked for a health check before the task's first query
    ctx = TaskContext(message=message, accepts_handoff=room)
    _chain()(ctx)
    while True:
        queue = ctx.job.queue if ctx.job is not None and ctx.may_pull else None  # None: no pull
        claimed = ctx.handoff or (claim_next(queue=queue, worker=worker_id()) if queue and room() else None)
        if claimed is None:
            return
        fault_point("before_handoff")
        runs_left -= 1
        ctx = TaskContext(message=claimed.envelope.to_message(), claim=worker_id(), run=claimed.run,
                          admission=claimed.admission, accepts_handoff=room)
        _chain()(ctx)


def _handoff_window_s() -> float:
    """FAIRSHARE["HANDOFF_WINDOW_S"], at most a tenth of this cluster's `timeout`: django-q2 times
    the whole loop as one task, and a run started late in it must not meet the timeout."""
    from django_q.conf import Conf

    window = settings.FAIRSHARE["HANDOFF_WINDOW_S"]
    return min(window, Conf.TIMEOUT / 10) if Conf.TIMEOUT else window
