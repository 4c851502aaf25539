"""Where a freed slot goes: to the first job of its account's line, released to the broker
(`release`), or claimed for a free worker that runs it without a broker round trip, under the
account's lock: handed to the settling worker (`claim_next`, from budgets.settlement), or pulled by
a worker with nothing handed to it, in fair order (`fetch_next`). If the claimant dies before the
run starts, claim and slot expire together and the job is released again: nothing lost or run twice.
"""
import datetime as dt
from dataclasses import replace

from django.db import transaction

from budgets import clock, ledger, standing
from budgets.ledger import Claimed
from budgets.locks import locked_standing
from budgets.standing import Standing
from scheduling import holding
from scheduling.models import ACCOUNT_WAITS_REASONS
from scheduling.registry import get_job

# How many accounts a pull looks at before it gives up (one it cannot use is passed over).
PULL_CANDIDATES = 4
# How many accounts' lines one tick of the pulse releases into free slots (the next takes the rest).
RELEASE_BATCH = 200


def release(*, account_id: int, queue: str, state: Standing, day: dt.date, limit: int | None = None,
            for_idle_worker: bool = False) -> int:
    """Under the lock: the first `releasable` jobs of the line (at most `limit`) to the broker; none
    while the broker's job waits, unless an idle worker asks: busy workers take them in fair order."""
    n = standing.releasable(state) if limit is None else min(limit, standing.releasable(state))
    if n <= 0:
        throttle(account_id=account_id, queue=queue, state=state)
        return 0
    if not for_idle_worker and ledger.broker_waiting(queue=queue):
        return 0
    released = ledger.release(account_id=account_id, queue=queue, day=day, limit=n)
    holding.send_on_commit_all(released)
    return len(released)


def throttle(*, account_id: int, queue: str, state: Standing) -> None:
    """Under the lock: a line that may not go for a time (budget spent, rate limit reached) is held
    up until then (scheduling.holding.block): no pull, hand-off or release looks at it meanwhile."""
    now = clock.now()
    refused = standing.refusal(state, now, pause=True) if state.in_line else None
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
    """A look after a commit: when the standing read without the lock lets held work go, `release_locked`."""
    state = ledger.standing(account_id=account_id, queue=queue, day=clock.budget_day())
    if state is None or not standing.releasable(state):
        return 0
    return release_locked(account_id=account_id, queue=queue)


def release_next(*, queue: str) -> int:
    """A freed slot whose worker goes back to the broker: the next job in fair order goes there."""
    for ready in ledger.ready_accounts(queue=queue, limit=PULL_CANDIDATES):
        if release_locked(account_id=ready.account_id, queue=queue, limit=1):
            return 1
    return 0


def release_due(*, idle_workers: dict[str, int] | None = None) -> int:
    """The pulse's tick: the lines that could go now into their free slots, in fair order; with
    `idle_workers` (per queue) one job per account, as many as idle workers. Returns how many went."""
    if idle_workers is None:
        return sum(release_locked(account_id=ready.account_id, queue=ready.queue)
                   for ready in ledger.ready_accounts(queue=None, limit=RELEASE_BATCH))
    return sum(release_locked(account_id=ready.account_id, queue=queue, limit=1, for_idle_worker=True)
               for queue, idle in idle_workers.items() if idle > 0
               for ready in ledger.ready_accounts(queue=queue, limit=idle))


def claim_next(*, account_id: int, queue: str, state: Standing, day: dt.date, worker: str,
             yield_to_broker: bool = True) -> Claimed | None:
    """Under the lock: the first job of the line claimed for `worker` into a free slot (unless
    `yield_to_broker` and the broker's job waits), admitted ahead: it only starts (what `refusal`
    lets go it lets start: free slots, budget and starts left with the jobs on their way counted)."""
    if not standing.releasable(state):
        throttle(account_id=account_id, queue=queue, state=state)
        return None
    # A step (what the claim statement can know); the rest of a larger estimate once it says which job.
    step_ms = standing.first_reservation_ms(state, 0)
    claimed = ledger.claim_for(account_id=account_id, queue=queue, day=day, worker=worker, reserve_ms=step_ms,
                               usage=ledger.usage_id(state, account_id=account_id, queue=queue, day=day),
                               yield_to_broker=yield_to_broker)
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
    """A held job of `queue` claimed for `worker` in fair order, none while the broker's job waits. A
    candidate whose share grew past the next one's since the order was read is passed over."""
    if ledger.broker_waiting(queue=queue):
        return None
    day = clock.budget_day()
    candidates = ledger.ready_accounts(queue=queue, limit=PULL_CANDIDATES)
    for ready, after in zip(candidates, [*candidates[1:], None]):
        with transaction.atomic():
            # Waits for the lock: skipping a locked account would pass over the busiest account.
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
