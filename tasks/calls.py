"""A task call's states and the one function per transition between them (the model:
exports/leases.py). Each transition is one guarded UPDATE whose `== 1` is the verdict.

    READY ──claim──▶ RUNNING ──complete──▶ SUCCESSFUL
      ▲  ◀─unclaim (admitted, not run)┤
      │  ◀─fail (will retry)─┤ ──fail (final)──▶ FAILED ◀──give_up── READY (after a retry was refused)
      │  ◀─give_back (cap)───┤ ──lost (no attempt left)──▶ FAILED
      │  ◀─lost (attempt left)┘
      ├──cancel──▶ FAILED
      └──────────retry (an operator)────────── FAILED

The fence is the call's `run`: a claim makes the claiming run's TaskRun the call's, and every
write of a run is guarded by it, so a run that lost its call (its worker froze, the reconciler
gave the call to another run) writes nothing. Transitions that write what they read (the errors)
compare and swap on the status and that same field. The claim and the completion, which every
call pays for, are hand-written statements (tasks/statements.py), which a worker sends in the round
trips and transactions of its run's admission and settlement when it can (`claim_along`,
`complete_along`: tasks.execution.CallMiddleware).
"""
from collections.abc import Callable
from dataclasses import dataclass

from django.db.models import F
from django.utils import timezone

from tasks import payload, statements
from tasks.compat import TaskResultStatus as Status
from tasks.exceptions import Cancelled, OutOfAttempts, WorkerLost
from tasks.models import TaskCall


@dataclass(frozen=True)
class Claimed:
    """A call claimed by a run: the row as the claim left it (and, claimed along with the run's
    admission, what the claim changed as it was: `unclaim`)."""

    call: TaskCall
    run_id: int
    prior: statements.Prior | None = None


def claim(*, call_id, worker: str, run_id: int) -> Claimed | None:
    """READY -> RUNNING for the run `run_id` on `worker` (one more worker id, one more attempt):
    one statement (tasks/statements.py). None when the call is not ready (finished, running
    elsewhere, cancelled, pruned) or another delivery claimed it first. A ready call out of
    attempts is failed instead (READY -> FAILED)."""
    call = statements.claim(call_id=call_id, worker=worker, run_id=run_id, now=timezone.now())
    if call is not None:
        return Claimed(call=call, run_id=run_id)
    spent = TaskCall.objects.filter(pk=call_id, status=Status.READY, attempt_count__gte=F("attempt_limit")).first()
    if spent is not None:
        error = payload.recorded_error(OutOfAttempts, f"a message arrived after all {spent.attempt_limit} attempts")
        _swap(spent, status=Status.FAILED, errors=[*spent.errors, error], finished_at=timezone.now())
    return None


def claim_along(*, call_id, worker: str, run, then: Callable[[Claimed | None], None]) -> object:
    """READY -> RUNNING as `claim`, for the run `run` the next of Fairshare's statements on this
    connection records as started (its admission): in that statement's round trip and transaction
    (tasks/statements.py `claim_along`). `then` gets the claim, or None when that statement
    recorded no such run or the call was not READY with an attempt left (then `claim` decides).
    Returns its place in the queue, to take it back unsent (scheduling.db.withdraw_along)."""
    return statements.claim_along(call_id=call_id, worker=worker, run=run, then=lambda call, prior: then(
        None if call is None else Claimed(call=call, run_id=call.run_id, prior=prior)))


def unclaim(claimed: Claimed) -> bool:
    """RUNNING -> READY as the claim along with the admission found it (its attempt, workers, times
    and run as they were): the run was admitted but did not run the call (its admission found a
    pause, or its start failed), which must stay READY as for a run refused or held."""
    prior = claimed.prior
    workers = "".join(claimed.call.workers.splitlines(keepends=True)[:-1])
    return _of_run(claimed, status=Status.READY, attempt_count=claimed.call.attempt_count - 1, workers=workers,
                   run_id=prior.run_id, started_at=prior.started_at, last_attempted_at=prior.last_attempted_at)


def _swap(call: TaskCall, **values) -> bool:
    """Write `values` if the call is still in the state and with the run it was read with (and
    then reflect them in `call`)."""
    if TaskCall.objects.filter(pk=call.pk, status=call.status, run_id=call.run_id).update(**values) != 1:
        return False
    for name, value in values.items():
        setattr(call, name, value)
    return True


def _of_run(claimed: Claimed, **values) -> bool:
    """Write `values` while the run still holds the call, and reflect them in `claimed.call`."""
    if TaskCall.objects.filter(pk=claimed.call.pk, status=Status.RUNNING, run_id=claimed.run_id).update(**values) != 1:
        return False
    for name, value in values.items():
        setattr(claimed.call, name, value)
    return True


def complete(claimed: Claimed, *, value) -> bool:
    """RUNNING -> SUCCESSFUL with the stored return value (one statement: tasks/statements.py)."""
    now = timezone.now()
    if not statements.complete(call=claimed.call, run_id=claimed.run_id, value=value, now=now):
        return False
    claimed.call.status, claimed.call.return_value, claimed.call.finished_at = Status.SUCCESSFUL, value, now
    return True


def complete_along(claimed: Claimed, *, value, then: Callable[[bool], None]) -> None:
    """`complete`, in the round trip and transaction of the next of Fairshare's statements on this
    connection (the run's settlement); `then(completed)` once that is committed."""
    now = timezone.now()

    def verdict(completed: bool) -> None:
        if completed:
            claimed.call.status, claimed.call.return_value, claimed.call.finished_at = Status.SUCCESSFUL, value, now
        then(completed)

    statements.complete_along(call=claimed.call, run_id=claimed.run_id, value=value, now=now, then=verdict)


def fail(claimed: Claimed, *, error: dict, final: bool) -> bool:
    """RUNNING -> FAILED (final) or READY (the retry middleware may send it again, or give up),
    with this attempt's error added. While the run holds the call nobody else writes its errors."""
    values = {"status": Status.FAILED, "finished_at": timezone.now()} if final else {"status": Status.READY}
    return _of_run(claimed, errors=[*claimed.call.errors, error], **values)


def give_back(claimed: Claimed) -> bool:
    """RUNNING -> READY without counting the attempt: the run had to stop and wait (the daily CPU
    cap), not fail."""
    return _of_run(claimed, status=Status.READY, attempt_count=claimed.call.attempt_count - 1)


def give_up(*, call_id, run_id: int) -> bool:
    """READY -> FAILED: the retry middleware will not send again what this run left ready (out of
    retries, or work without an account, which is not retried). The error is on record already."""
    return TaskCall.objects.filter(pk=call_id, status=Status.READY, run_id=run_id).update(
        status=Status.FAILED, finished_at=timezone.now()) == 1


def lost(call: TaskCall) -> str | None:
    """RUNNING -> READY, or FAILED when no attempt is left: the run that held the call is over
    (its worker died) and the call was never finished. Returns the new status, or None when the
    call changed since it was read."""
    worker = call.worker_ids[-1] if call.worker_ids else "?"
    error = payload.recorded_error(WorkerLost, f"the worker {worker} stopped while the task ran")
    status = Status.READY if call.attempt_count < call.attempt_limit else Status.FAILED
    when = {"finished_at": timezone.now()} if status == Status.FAILED else {"sent_at": timezone.now()}
    return status if _swap(call, status=status, errors=[*call.errors, error], **when) else None


def cancel(call: TaskCall, *, by: str) -> bool:
    """READY -> FAILED: an operator cancelled it before it ran."""
    error = payload.recorded_error(Cancelled, f"cancelled by {by} before it ran")
    return _swap(call, status=Status.FAILED, errors=[*call.errors, error], finished_at=timezone.now())


def retry(call: TaskCall, *, attempts: int) -> bool:
    """FAILED -> READY with `attempts` more attempts: an operator runs it again (same id; its
    errors stay on record)."""
    return _swap(call, status=Status.READY, attempt_limit=call.attempt_count + attempts, finished_at=None,
                 return_value=None, sent_at=timezone.now())


def resent(call: TaskCall) -> bool:
    """READY stays READY: its message was sent again (the reconciler's, for a lost one)."""
    return _swap(call, sent_at=timezone.now())
