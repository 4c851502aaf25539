"""Settlement: after a run, charge what it measured, free its slot and reservation, record how it
ended, and give the freed slot on. Exactly once: the charge deletes the slot. It takes no lock
(budgets.ledger.settling says why); only with work in the account's line is the lock taken to hand on.
"""
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction

from budgets import clock, ledger, standing
from budgets.admission import hold_and_wake
from budgets.handoff import claim_next, passed_on, release_next
from budgets.ledger import Claimed, PassOn
from budgets.locks import lock, locked_standing
from budgets.standing import Standing
from scheduling import holding
from scheduling.envelope import Envelope
from scheduling.faults import fault_point
from scheduling.metering import Meter
from scheduling.models import DeferReason
from scheduling.services import RunEnd


@dataclass(frozen=True)
class Settled:
    """What a settlement did with the freed slot."""

    handed_to: Claimed | None = None  # the held job claimed for the settling worker, to run next
    waiting: bool = True  # some account's held work on the queue may wait for a worker (False: a pull finds none)


def settle(*, slot_id: int, account_id: int, queue: str, meter: Meter, outcome: str | None = None, items: int = 0,
           error: BaseException | None = None, cap_hit: bool = False, slot_lost: bool = False,
           envelope: Envelope | None = None, hand_to: str | None = None, from_line: bool = False,
           look_again_later: Callable[..., None] | None = None) -> Settled | None:
    """Settle a run (None: settled already), with `outcome` how it ended. A run stopped by the cap
    (`cap_hit`) or whose slot was lost is held again. The freed slot goes to the account's first held
    job, claimed for worker `hand_to` (returned) or released; from the line (`from_line`) the charge
    passes it on when it may; another account's turn first, by the fair order. `look_again_later`
    (the watcher) makes the look after the commit, for a hold that committed while the charge ran."""
    now = clock.now()
    day = clock.budget_day(now)
    end = RunEnd(meter=meter, outcome=outcome, items=items, error=error)
    if (cap_hit or slot_lost) and envelope is not None:
        return _settle_and_hold(slot_id=slot_id, account_id=account_id, queue=queue, meter=meter, end=end,
                                cap_hit=cap_hit, envelope=envelope, hand_to=hand_to, now=now, day=day)
    pass_on = PassOn(worker=hand_to, day=day, lease_s=standing.claim_lease_s()) if hand_to and from_line else None
    # Recorded as finished in the statement that frees its slot: before the next run on it starts.
    charged = ledger.charge(slot_id=slot_id, account_id=account_id, queue=queue, meter=meter, cap_hit=cap_hit,
                            end=end, now=now, pass_on=pass_on)
    if charged is None:
        return None
    if charged.passed is not None:
        fault_point("after_pass_on")
        return Settled(handed_to=passed_on(charged.passed))
    handed_to = None
    if charged.was_active and not charged.in_line and look_again_later is not None:
        look_again_later(account_id=account_id, queue=queue)
    elif charged.was_active and charged.others_waiting:
        if hand_to is None:  # else the worker pulls in the fair order
            release_next(queue=queue)
    elif charged.was_active and (charged.in_line or holding.in_line(account_id=account_id, queue=queue)):
        with transaction.atomic():
            state = locked_standing(account_id=account_id, queue=queue, day=day)
            handed_to = _give_freed_slot(account_id=account_id, queue=queue, state=state, day=day, hand_to=hand_to)
        if handed_to is None and hand_to is None:
            release_next(queue=queue)
    return Settled(handed_to=handed_to, waiting=charged.waiting or handed_to is not None)


def _settle_and_hold(*, slot_id: int, account_id: int, queue: str, meter: Meter, end: RunEnd, cap_hit: bool,
                     envelope: Envelope, hand_to: str | None, now: dt.datetime, day: dt.date) -> Settled | None:
    """A run stopped before its job was done: charge, hold and hand-off in one locked transaction."""
    with transaction.atomic():
        lock(account_id=account_id, queue=queue)
        charged = ledger.charge(slot_id=slot_id, account_id=account_id, queue=queue, meter=meter, cap_hit=cap_hit,
                                end=end, now=now)
        if charged is None:
            return None
        state = ledger.standing(account_id=account_id, queue=queue, day=day)
        if not cap_hit:
            reason, eligible_at = DeferReason.CONCURRENCY_CAP, now  # its slot went to another: it waits for one
        elif state.unreserved_ms > 0:  # its account's other runs left some: it may go on with that
            reason, eligible_at = DeferReason.BUDGET_RESERVED, now
        else:
            reason, eligible_at = standing.out_of_budget(state, now)
        hold_and_wake(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
        state = ledger.standing(account_id=account_id, queue=queue, day=day)  # with the job it held
        handed_to = _give_freed_slot(account_id=account_id, queue=queue, state=state, day=day, hand_to=hand_to) \
            if charged.was_active else None
    if charged.was_active and handed_to is None and hand_to is None:
        release_next(queue=queue)
    return Settled(handed_to=handed_to, waiting=charged.waiting or handed_to is not None)


def _give_freed_slot(*, account_id: int, queue: str, state: Standing, day: dt.date, hand_to: str | None) -> Claimed | None:
    """Under the lock: the freed slot to the account's first held job, claimed for `hand_to`. Without
    a worker the caller releases in fair order after its commit; with one whose line may not go on,
    nothing is: the worker pulls itself (budgets.gate.next_for), not idle behind a released job."""
    if hand_to is None:
        return None
    return claim_next(account_id=account_id, queue=queue, state=state, day=day, worker=hand_to)
