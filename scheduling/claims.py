"""Claims on held work: a worker takes the first job of an account's line to run it itself, straight
away, without a broker round trip (a hand-off when its account's run settles, a pull when a worker
is free). The held row stays, marked with the worker and the claim's lease, until that run starts
(`complete_claim`); a claim whose lease expired is claimable again (scheduling.holding.claimable),
once the caller's `let_go` says its claimant let it go. The portable forms; other apps'
hand-written statements use scheduling.sql's `claim`, `complete_claim` and `claim_held`.

What each reads as held jobs grow: a claim the first claimable rows of one account's line (index
deferred_line), the others one row by its (job, ref) key. EXPLAINed in
tests/scheduling/test_held_work_cost.py.
"""
import datetime as dt

from django.db.models import Q

from scheduling import clock
from scheduling.holding import LINE_ORDER, claimable
from scheduling.models import DeferredTask


def claim(*, account_id: int, queue: str, worker: str, lease_s: float, let_go: Q | None = None) -> DeferredTask | None:
    """Claim the first job of the account's line for `worker`, which runs it itself (SKIP LOCKED:
    two workers never claim the same job, and neither waits for the other). The caller decides,
    under the account's lock, that a slot is there for it. `let_go`: the caller's condition on a
    held job for taking it over once its claim expired (budgets': the claim's slot was given back,
    so its claimant cannot have started it)."""
    now = clock.now()
    first = (DeferredTask.objects.select_for_update(skip_locked=True)
             .filter(claimable(now), let_go or Q(), account_id=account_id, queue=queue).order_by(*LINE_ORDER).first())
    if first is None:
        return None
    first.claimed_by, first.claim_expires_at = worker, now + dt.timedelta(seconds=lease_s)
    DeferredTask.objects.filter(pk=first.pk).update(claimed_by=first.claimed_by, claim_expires_at=first.claim_expires_at)
    return first


def claim_held(*, job: str, ref: str, worker: str) -> bool:
    """Whether `worker` still holds its claim on the job."""
    return DeferredTask.objects.filter(job=job, ref=ref, claimed_by=worker).exists()


def complete_claim(*, job: str, ref: str, worker: str) -> bool:
    """The claimed job's run starts: it leaves the holding area, if `worker` still holds its claim
    (held again meanwhile, it must not run). Call it where the claim was seen held, under a lock
    that keeps others from taking it (the account's Budget row)."""
    deleted, _ = DeferredTask.objects.filter(job=job, ref=ref, claimed_by=worker).delete()
    return deleted > 0
