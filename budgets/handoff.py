"""Where a freed slot goes: to the first job of its account's line, released to the broker
(`release`), or, for work conservation, claimed for a free worker that runs it without a broker
round trip, under the account's lock, the job's slot taken in the claim's statement:
- hand-off: a settlement that frees a slot gives it to the same account's first held job, claimed
  for the settling worker (`claim_next`, called by budgets.settlement);
- pull: a worker with nothing handed off claims another account's job into a free slot, in fair
  order (`fetch_next`). A settlement that sees another account's turn come first leaves its freed
  slot to this order instead of handing it to its own account's next job.
(The pass-on is the settlement's own statement.) If the claimant dies before the run starts, the
claim and the slot expire together and the job is released again: nothing is lost or run twice.
These read the account's standing and the first rows of its line; a pull and the pulse's
`release_due` the accounts whose line could go now (`ready_accounts`), never the held jobs.
"""
import datetime as dt
from dataclasses import replace

from django.db import transaction

from budgets import clock, standing
from budgets import ledger
from budgets.ledger import Claimed
from budgets.locks import locked_standing
from budgets.standing import Standing
from scheduling import holding
from scheduling.envelope import Envelope
from scheduling.models import ACCOUNT_WAITS_REASONS
from scheduling.registry import get_job

# How many accounts a pull looks at before it gives up (each one it cannot use is passed over: its
# share grew past the next one's since the order was read, or the slot it had free was taken).
PULL_CANDIDATES = 4
# How many accounts' lines one tick of the pulse releases into free slots (the next takes the rest).
RELEASE_BATCH = 200


def release(*, account_id: int, queue: str, state: Standing, day: dt.date, limit: int | None = None,
            for_idle_worker: bool = False) -> int:
    """Under the lock: send the first jobs of the account's line into its free slots, as many as
    `releasable`, at most `limit`. None while a job sent to the broker waits for a worker, unless an
    idle worker asks (`for_idle_worker`): the busy workers' loops take the line in the fair order."""
    n = standing.releasable(state) if limit is None else min(limit, standing.releasable(state))
    if n <= 0:
        throttle(account_id=account_id, queue=queue, state=state)
        return 0
    if not for_idle_worker and ledger.broker_waiting(queue=queue):
        return 0
    released = holding.release_first(account_id=account_id, queue=queue, limit=n, may_take_over=ledger.may_take_over())
    ledger.dispatch_many(envelopes=[Envelope(job=held.job, account=account_id, ref=held.ref, priority=held.priority)
                                      for held in released], queue=queue, day=day)
    return len(released)


def throttle(*, account_id: int, queue: str, state: Standing) -> None:
    """Under the lock: an account whose line lets nothing go for a time (budget spent, rate limit
    reached) has its line held up until then (scheduling.holding.block): no pull, hand-off or
    release looks at it meanwhile."""
    if not state.in_line:
        return
    now = clock.now()
    refused = standing.refusal(state, now, pause=True)
    if refused is not None and refused[0] in ACCOUNT_WAITS_REASONS and refused[1] > now:
        holding.block(account_id=account_id, queue=queue, until=refused[1], reason=refused[0])


def release_locked(*, account_id: int, queue: str, limit: int | None = None, for_idle_worker: bool = False) -> int:
    """`release` in a transaction of its own, under the lock."""
    day = clock.budget_day()
    with transaction.atomic():
        state = locked_standing(account_id=account_id, queue=queue, day=day)
        return release(account_id=account_id, queue=queue, state=state, day=day, limit=limit,
                       for_idle_worker=for_idle_worker)


def release_if_ready(*, account_id: int, queue: str) -> int:
    """A look after a commit (a hold's, a settlement's): when the standing, read without the lock,
    lets held work go, release it under the lock. Returns how many went."""
    state = ledger.standing(account_id=account_id, queue=queue, day=clock.budget_day())
    if state is None or not standing.releasable(state):
        return 0
    return release_locked(account_id=account_id, queue=queue)


def release_next(*, queue: str) -> int:
    """A freed slot whose worker goes back to the broker: the next job of the account whose turn
    it is goes to the broker, not the settling account's. Returns how many went."""
    for ready in ledger.ready_accounts(queue=queue, limit=PULL_CANDIDATES):
        if release_locked(account_id=ready.account_id, queue=queue, limit=1):
            return 1
    return 0


def release_due(*, idle_workers: dict[str, int] | None = None) -> int:
    """The pulse's tick for budgets: the lines of the accounts that could run now go into their
    free slots, in fair order. With `idle_workers` (per queue) one job per account, as many as
    there are idle workers: the busy workers take the rest by hand-off and pull, in the fair order.
    Returns how many jobs went."""
    if idle_workers is None:
        return sum(release_locked(account_id=ready.account_id, queue=ready.queue)
                   for ready in ledger.ready_accounts(queue=None, limit=RELEASE_BATCH))
    return sum(release_locked(account_id=ready.account_id, queue=queue, limit=1, for_idle_worker=True)
               for queue, idle in idle_workers.items() if idle > 0
               for ready in ledger.ready_accounts(queue=queue, limit=idle))


def claim_next(*, account_id: int, queue: str, state: Standing, day: dt.date, worker: str,
             yield_to_broker: bool = True) -> Claimed | None:
    """Under the account's lock (a settlement that freed a slot, or a pull): claim the first job of
    its line for `worker` into the free slot, unless (`yield_to_broker`) a job sent to the broker
    waits for a worker. When its account may start it (`Standing.may_start`) it is admitted in the
    same statement and only starts; else its own admission decides when, as for any claimed job."""
    if not standing.releasable(state):
        throttle(account_id=account_id, queue=queue, state=state)
        return None
    if not state.may_start:
        return ledger.claim_for(account_id=account_id, queue=queue, day=day, worker=worker,
                                yield_to_broker=yield_to_broker)
    # A step (what the claim statement can know); the rest of a larger estimate once it says which job.
    step_ms = standing.first_reservation_ms(state, 0)
    claimed = ledger.claim_and_admit(account_id=account_id, queue=queue, state=state, day=day, worker=worker,
                                     reserve_ms=step_ms, yield_to_broker=yield_to_broker)
    if claimed is None:
        return None
    estimate_ms = get_job(claimed.envelope.job).cpu_estimate_ms
    return _reserve_more(claimed, standing.first_reservation_ms(state, estimate_ms) - step_ms, checked=True)


def passed_on(claimed: Claimed) -> Claimed:
    """The job a settlement passed its slot on to (admitted: it only starts), with the rest of its
    estimate reserved when its account has that much left (else its watcher asks as it runs)."""
    return _reserve_more(claimed, get_job(claimed.envelope.job).cpu_estimate_ms - claimed.reserved_ms, checked=False)


def _reserve_more(claimed: Claimed, ms: int, *, checked: bool) -> Claimed:
    if ms > 0 and ledger.reserve_more(slot_id=claimed.slot_id, usage_id=claimed.usage_id, ms=ms, checked=checked):
        return replace(claimed, reserved_ms=claimed.reserved_ms + ms)
    return claimed


def fetch_next(*, queue: str, worker: str) -> Claimed | None:
    """Claim one held job of `queue` for `worker` into a free slot, in fair order; none while a job
    sent to the broker waits for a worker (it goes first). The order is read before the lock: a
    candidate whose share grew past the next one's meanwhile (another worker pulled it) is passed
    over, so that workers pulling at once spread over the accounts."""
    if ledger.broker_waiting(queue=queue):
        return None
    day = clock.budget_day()
    candidates = ledger.ready_accounts(queue=queue, limit=PULL_CANDIDATES)
    for ready, after in zip(candidates, [*candidates[1:], None]):
        with transaction.atomic():
            # It waits for the lock (one short statement): skipping a locked account would pass
            # over the busiest account, whose lock is taken most often, whatever its weight.
            if not ledger.lock(account_id=ready.account_id, queue=queue):
                continue
            state = ledger.standing(account_id=ready.account_id, queue=queue, day=day)
            if after is not None and state.in_flight / state.weight > after.share:
                continue
            claimed = claim_next(account_id=ready.account_id, queue=queue, state=state, day=day, worker=worker,
                               yield_to_broker=False)  # (it looked above)
        if claimed is not None:
            return claimed
    return None
