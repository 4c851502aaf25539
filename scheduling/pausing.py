"""Pausing an account or a whole queue: its new work waits in the holding area with reason
"paused" instead of running, and resuming releases it.

Plugged in like any other concern: `PauseGate` in FAIRSHARE["ENQUEUE_GATES"] (first, so a paused
job takes no budget slot) holds work at enqueue time, and `PauseMiddleware` in
FAIRSHARE["TASK_MIDDLEWARE"] holds work that was already on its way (sent before the pause, or
released by an operator). Only account work pauses: system jobs (maintenance) always run.
"""
import datetime as dt

from django.db import IntegrityError, transaction
from django.db.models import Q

from scheduling import db, holding
from scheduling.envelope import Envelope
from scheduling.gates import EnqueueGate
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause
from scheduling.operator import ItemResult, log_action, refusal

# Paused work is not due until an operator resumes it: no release_due() may pick it up.
UNTIL_RESUMED = dt.datetime(9999, 1, 1, tzinfo=dt.UTC)


def _covering(*, account_id: int, queue: str):
    return Pause.objects.filter(Q(account_id=account_id, queue__in=["", queue]) | Q(account__isnull=True, queue=queue))


def covered(*, account_id: int, queue: str) -> bool:
    """Whether a pause covers the account's work on the queue."""
    # Hand-written (`_covering`'s condition, as the SQL function fairshare_pauses of migration 0023
    # writes it): it runs for every job enqueued, and the ORM cost more than the query.
    with db.cursor() as cursor:
        cursor.execute("SELECT EXISTS (SELECT 1 FROM fairshare_pauses(%(account_id)s, %(queue)s))",
                       {"account_id": account_id, "queue": queue})
        return bool(cursor.fetchone()[0])


def hold_if_paused(*, envelope: Envelope, queue: str) -> bool:
    """Hold the job with reason "paused" when a pause covers it; True when it did."""
    if not covered(account_id=envelope.account, queue=queue):
        # The common case, in one query and no transaction. A pause committed just after this
        # check is caught when the job starts (PauseMiddleware).
        return False
    covering = _covering(account_id=envelope.account, queue=queue)
    with transaction.atomic():
        # Row lock on the covering pause: a resume deletes that row first, so it waits for this
        # hold to commit and then releases it too; without the lock, a job checked just before
        # the resume would be held after the resume had released everything, and wait for ever.
        if not list(covering.select_for_update(no_key=True)):
            return False
        holding.hold(envelope=envelope, queue=queue, reason=DeferReason.PAUSED, eligible_at=UNTIL_RESUMED)
        return True


class PauseGate(EnqueueGate):
    """The enqueue gate: paused work goes to the holding area."""

    def admit(self, *, envelope: Envelope, queue: str) -> bool:
        return not hold_if_paused(envelope=envelope, queue=queue)

    def admit_many(self, *, envelopes: list[Envelope], queue: str) -> list[bool]:
        """A batch (`enqueue_many`): one query per account; only a paused account's jobs each."""
        paused = {account for account in {e.account for e in envelopes} if covered(account_id=account, queue=queue)}
        return [e.account not in paused or not hold_if_paused(envelope=e, queue=queue) for e in envelopes]

    # `undo` takes back nothing (admitting took nothing), `release_due` releases nothing (paused
    # work is released by `resume`, never by time): the base class's.


class PauseMiddleware:
    """At the start of a run: paused work goes back to the holding area without running. For a
    chain without budgets' admission: budgets.middleware.BudgetMiddleware holds paused work itself
    (its admission reads whether a pause covers the job), so the default chain does not list this."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        if ctx.job.account_scoped and hold_if_paused(envelope=ctx.envelope, queue=ctx.job.queue):
            ctx.outcome = Outcome.DEFERRED
            return
        self.call_next(ctx)


def _scope(account, queue: str) -> str:
    return f"account {account}" + (f" on queue {queue}" if queue else "") if account else f"queue {queue}"


def pause(*, user, account=None, queue: str = "") -> ItemResult:
    """Pause an account (every queue, or one) or, with no account, a whole queue."""
    label = _scope(account, queue)
    why = refusal(user=user, account_id=account.pk if account else None, needs="operator")
    if why:
        return ItemResult(label, False, why)
    try:
        with transaction.atomic():
            row = Pause.objects.create(account=account, queue=queue, paused_by=user)
            log_action(user=user, obj=row, message=f"Paused {label}")
    except IntegrityError:  # the unique (account, queue) constraint: already paused
        return ItemResult(label, False, "already paused")
    return ItemResult(label, True, "paused: its new work waits in the holding area")


def resume(*, user, account=None, queue: str = "") -> ItemResult:
    """Lift a pause and release the work it held (unless another pause still covers it)."""
    label = _scope(account, queue)
    why = refusal(user=user, account_id=account.pk if account else None, needs="operator")
    if why:
        return ItemResult(label, False, why)
    with transaction.atomic():
        # Row lock: two resumes of one pause release its work once; a gate holding work under
        # this pause finishes first (see hold_if_paused).
        row = Pause.objects.select_for_update().filter(account=account, queue=queue).first()
        if row is None:
            return ItemResult(label, False, "not paused")
        log_action(user=user, obj=row, message=f"Resumed {label}")
        row.delete()
        held = DeferredTask.objects.filter(reason=DeferReason.PAUSED).only("pk", "account_id", "queue")
        held = held.filter(account=account, **({"queue": queue} if queue else {})) if account else held.filter(queue=queue)
        still = list(Pause.objects.values_list("account_id", "queue"))  # the pauses that remain
        ids = [task.pk for task in held if not any(
            (acct == task.account_id and q in ("", task.queue)) or (acct is None and q == task.queue) for acct, q in still)]
        released = holding.release_now(deferred_ids=ids)
    return ItemResult(label, True, f"resumed; released {released} held task(s)")
