"""The enqueue-time check for a batch (`scheduling.runtime.enqueue_many`): a flood of one
account's jobs is decided in one transaction per account instead of one check per job.

Under the account's lock it sends as many as fit the account's free slots and the starts its rate
limit has left (each dispatched, as budgets.admission.admit_at_enqueue would) when the account has
budget left and nothing in line,
and holds the rest with one insert, in order: the first for the reason it could not go, the
others queued behind it.
"""
import datetime as dt
from collections import defaultdict

from django.db import transaction
from django.db.models import F

from budgets import clock, standing
from budgets.admission import wake_when_committed
from budgets import ledger
from budgets.locks import locked_standing
from budgets.models import UsageDay
from budgets.standing import Standing
from scheduling.envelope import Envelope
from scheduling.holding import hold_many
from scheduling.models import DeferReason


def admit_many_at_enqueue(*, envelopes: list[Envelope], queue: str) -> list[bool]:
    """One verdict per envelope, in order: True when the caller should send it."""
    by_account: dict[int, list[int]] = defaultdict(list)
    for i, envelope in enumerate(envelopes):
        by_account[envelope.account].append(i)
    verdicts = [False] * len(envelopes)
    now = clock.now()
    day = clock.budget_day(now)
    for account_id, indexes in by_account.items():
        with transaction.atomic():
            state = locked_standing(account_id=account_id, queue=queue, day=day)
            free = 0 if state.unreserved_ms <= 0 or state.in_line else max(0, state.free_slots)
            fits = free if state.starts_left is None else min(free, state.starts_left)
            rate_bound = fits < free  # the rate limit, not the slots, stopped the batch
            busy = fits > 0 and ledger.broker_waiting(queue=queue)  # every worker busy: all of it waits in line
            fits = 0 if busy else fits
            go, wait = indexes[:fits], indexes[fits:]
            ledger.dispatch_many(envelopes=[envelopes[i] for i in go], queue=queue, day=day)
            for i in go:
                verdicts[i] = True
            if wait:
                _hold(state, [envelopes[i] for i in wait], account_id=account_id, queue=queue, day=day, now=now,
                      rate_bound=rate_bound, busy=busy)
    return verdicts


def _hold(state: Standing, envelopes: list[Envelope], *, account_id: int, queue: str, day: dt.date,
          now: dt.datetime, rate_bound: bool, busy: bool) -> None:
    if state.unreserved_ms <= 0:
        reason, eligible_at = standing.out_of_budget(state, now)
    elif busy:
        reason, eligible_at = DeferReason.WORKERS_BUSY, now
    elif rate_bound:
        reason, eligible_at = standing.rate_wait(state, now)
    else:
        reason, eligible_at = (DeferReason.QUEUED_BEHIND if state.in_line else DeferReason.CONCURRENCY_CAP), now
    hold_many(envelopes=envelopes[:1], queue=queue, reason=reason, eligible_at=eligible_at)
    if len(envelopes) > 1:
        behind = DeferReason.QUEUED_BEHIND if reason in (DeferReason.CONCURRENCY_CAP, DeferReason.RATE_LIMITED,
                                                         DeferReason.WORKERS_BUSY) \
            else reason
        hold_many(envelopes=envelopes[1:], queue=queue, reason=behind, eligible_at=eligible_at)
    wake_when_committed(account_id=account_id, queue=queue, reason=reason, eligible_at=eligible_at)
    usage_id = ledger.usage_id(state, account_id=account_id, queue=queue, day=day)
    UsageDay.objects.filter(pk=usage_id).update(deferrals=F("deferrals") + len(envelopes))
