"""The enqueue-time check for a batch (`scheduling.runtime.enqueue_many`), one transaction per
account: under its lock as many go as fit its free slots, its rate limit's starts and the queue's
idle workers, when `refusal` lets them; the rest are held in order, the first for the reason.
"""
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

from django.db import transaction
from django.db.models import F

from budgets import clock, ledger, standing
from budgets.admission import wake_when_committed
from budgets.locks import locked_standing
from budgets.models import UsageDay
from scheduling.envelope import Envelope
from scheduling.holding import hold_many
from scheduling.models import DeferReason

# The reasons for which the batch's jobs held after the first wait queued behind it.
BEHIND_THE_FIRST = (DeferReason.CONCURRENCY_CAP, DeferReason.RATE_LIMITED, DeferReason.WORKERS_BUSY)


def admit_many_at_enqueue(*, envelopes: list[Envelope], queue: str) -> list[bool]:
    """One verdict per envelope, in order: True when the caller should send it."""
    by_account: dict[int, list[int]] = defaultdict(list)
    for i, envelope in enumerate(envelopes):
        by_account[envelope.account].append(i)
    verdicts = [False] * len(envelopes)
    now = clock.now()
    day = clock.budget_day(now)
    # What the queue's workers could start now, read once: the accounts' sends take from it in turn.
    idle = ledger.idle_workers(queue=queue)
    broker_waiting = functools.cache(lambda: ledger.broker_waiting(queue=queue))

    def busy(idle: int | None) -> Callable[[], bool]:  # no worker could start one more job now
        return lambda: (idle is not None and idle <= 0) or broker_waiting()

    for account_id, indexes in by_account.items():
        with transaction.atomic():
            state = locked_standing(account_id=account_id, queue=queue, day=day)
            fits = 0
            if standing.refusal(state, now, line=True, workers_busy=busy(idle)) is None:
                fits = standing.room(state)
                if idle is not None:
                    fits = min(fits, idle)
                    idle -= fits
            go, wait = indexes[:fits], indexes[fits:]
            ledger.dispatch_many(envelopes=[envelopes[i] for i in go], queue=queue, day=day)
            for i in go:
                verdicts[i] = True
            if wait:
                # The first held job's reason is the rule's for the account once the batch's first
                # `fits` took their slots (each on its way, for the rate limit as for the cap).
                after = replace(state, in_flight=state.in_flight + fits)
                reason, eligible_at = standing.refusal(after, now, line=True, workers_busy=busy(idle))
                behind = DeferReason.QUEUED_BEHIND if reason in BEHIND_THE_FIRST else reason
                hold_many(envelopes=[envelopes[wait[0]]], queue=queue, reason=reason, eligible_at=eligible_at)
                hold_many(envelopes=[envelopes[i] for i in wait[1:]], queue=queue, reason=behind,
                          eligible_at=eligible_at)
                wake_when_committed(account_id=account_id, queue=queue, reason=reason, eligible_at=eligible_at)
                usage_id = ledger.usage_id(state, account_id=account_id, queue=queue, day=day)
                UsageDay.objects.filter(pk=usage_id).update(deferrals=F("deferrals") + len(wait))
    return verdicts
