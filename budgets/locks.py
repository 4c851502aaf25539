"""The account's lock on a queue (its Budget row, budgets.standing says what it serialises) and the
standing read under it. Call these inside a transaction: the lock is held until it ends."""
import datetime as dt
from dataclasses import replace

from budgets import ledger
from budgets.models import Account, Budget
from budgets.plans import budgets_ensure_defaults
from budgets.standing import Standing
from scheduling.envelope import Envelope
from scheduling.holding import unblock


def lock(*, account_id: int, queue: str) -> None:
    """Take the account's lock on the queue, creating its plan's budgets if it has none yet."""
    if not ledger.lock(account_id=account_id, queue=queue):
        budgets_ensure_defaults(account=Account.objects.get(pk=account_id))
        if not ledger.lock(account_id=account_id, queue=queue):
            raise Budget.DoesNotExist(f"account {account_id} has no budget on queue {queue!r}")


def locked_standing(*, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None) -> Standing:
    """`lock`, then the account's standing, exact until the transaction ends (READ COMMITTED: a
    statement after the lock sees everything committed before it was granted).

    A line held up (scheduling.holding.block: until the next budget day, or until a start leaves
    its rate limit's window) while its standing lets work start again (budget raised by an operator
    or by a write that went around budgets.adjust; a rate limit raised) is let go here: the
    accounts that could run are found by that block (budgets.ledger `ready_accounts`), never by
    reading every account's budget."""
    lock(account_id=account_id, queue=queue)
    state = ledger.standing(account_id=account_id, queue=queue, day=day, envelope=envelope)
    if state is not None and state.blocked and state.unreserved_ms > 0 and not state.rate_full:
        unblock(account_id=account_id, queue=queue)
        state = replace(state, blocked=False)
    return state
