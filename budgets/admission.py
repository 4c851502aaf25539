"""Admission: may a job go to the broker now (`admit_at_enqueue`), and may it start now (`admit`,
`start_admitted`)? Yes takes a slot and reserves CPU (budgets.ledger's transitions); no puts the
job in the holding area with its reason and the time it may go. A held job costs no attempt.
"""
import datetime as dt
from dataclasses import dataclass

from django.db import transaction
from django.db.models import F

from budgets import clock, standing
from budgets.handoff import release_if_ready
from budgets import ledger
from budgets.ledger import Claimed
from budgets.locks import lock, locked_standing
from budgets.models import UsageDay
from budgets.standing import Standing
from scheduling.envelope import Envelope
from scheduling.holding import hold
from scheduling.models import DeferReason, TaskRun
from scheduling.services import task_run_mark_started


@dataclass(frozen=True)
class Admission:
    slot_id: int | None
    reason: str | None = None  # a DeferReason when refused (None: a claim that was lost, nothing held)
    eligible_at: dt.datetime | None = None
    allowance_ms: int = 0  # the CPU reserved for this run: it stops there unless it can reserve more
    paused: bool = False  # a pause covered the job when it was admitted (scheduling.pausing)

    @property
    def admitted(self) -> bool:
        return self.slot_id is not None


def admit_at_enqueue(*, envelope: Envelope, queue: str) -> bool:
    """The enqueue-time check: may the job go to the broker? If so it takes a slot (dispatched);
    if not it joins the holding area. Returns True when the caller should send it.

    It is held for the first reason `standing.refusal` finds (out of budget today, its rate limit
    reached, no free slot on this queue, work in line before it: it waits behind it, in line order),
    and when no worker of the queue could start it now (each runs or is sent a job:
    fairshare_idle_workers; or a job sent to the broker waits for one): then the busy
    workers' loops take it from the line in the fair order (budgets.handoff), and what the broker
    holds stays as short as the number of workers, instead of a flood waiting there first in,
    first out. CPU is reserved when it starts.
    A job sent again while its first message has not started (a reconciler's re-send) goes out
    on the slot it already holds. The common case takes no lock and one statement on PostgreSQL
    (sent or held): a job sent on a stale view is checked again when it starts.
    """
    now = clock.now()
    day = clock.budget_day(now)
    checked = ledger.dispatch_or_hold(envelope=envelope, queue=queue, day=day)
    if checked.decided:
        return checked.slot_id is not None
    workers_free = checked.workers_free
    with transaction.atomic():
        state = locked_standing(account_id=envelope.account, queue=queue, day=day, envelope=envelope)
        if state.own_slot is not None:
            ledger.redispatch(slot_id=state.own_slot)
            return True
        refused = standing.refusal(state, now, line=True,
                                   workers_busy=lambda: not workers_free or ledger.broker_waiting(queue=queue))
        if refused is None:
            ledger.dispatch(envelope=envelope, queue=queue, day=day)
            return True
        reason, eligible_at = refused
        hold_counted(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
    return False


def undispatch(*, envelope: Envelope, queue: str) -> None:
    """The job could not be sent after all (the broker refused it): give its slot back."""
    ledger.undispatch(envelope=envelope, queue=queue)


def admit(*, envelope: Envelope, queue: str, estimate_ms: int, worker: str, run: TaskRun | None = None) -> Admission:
    """At the start of a run: take a slot and reserve CPU, or put the job on hold.

    A job sent by `admit_at_enqueue` (or released from the holding area) takes over the slot its
    dispatch holds; anything else (a duplicate delivery, an operator's release) needs a free one.
    (A job claimed from the holding area was admitted with its claim: `start_admitted`.) An
    admitted run's record (`run`: inserted when not saved yet) is started with its slot.

    The common case — a job sent with a slot of its own, its account plainly below its caps —
    is one statement on PostgreSQL, without taking the lock first (`admit_at_once`); anything
    else is decided under the lock.
    """
    if run is not None and run.pk is None:
        reserve_ms = standing.step_ms(estimate_ms)
        at_once = ledger.admit_at_once(envelope=envelope, queue=queue, day=clock.budget_day(),
                                         reserve_ms=reserve_ms, run=run, worker=worker)
        if at_once.slot_id is not None:
            return Admission(at_once.slot_id, allowance_ms=reserve_ms, paused=at_once.paused)
    with transaction.atomic():
        now = clock.now()
        day = clock.budget_day(now)
        state = locked_standing(account_id=envelope.account, queue=queue, day=day, envelope=envelope)
        own = state.own_slot
        refused = standing.refusal(state, now, at_start=True)
        if refused is not None:
            if own is not None:
                ledger.drop(slot_id=own)
            reason, eligible_at = refused
            hold_counted(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
            return Admission(None, reason, eligible_at)
        reserve_ms = standing.first_reservation_ms(state, estimate_ms)
        # An admitted run is recorded from the moment it holds its slot (taken under the lock, so
        # after the settlement that freed the slot committed): the recorded runs of an account
        # never overlap more than its concurrency cap allows.
        if run is not None and run.pk is not None:
            task_run_mark_started(run=run)
        slot_id = ledger.activate(envelope=envelope, queue=queue, state=state, day=day, own=own,
                                    reserve_ms=reserve_ms, run=run, worker=worker)
    return Admission(slot_id, allowance_ms=reserve_ms, paused=state.paused)


def start_admitted(*, claimed: Claimed, queue: str, worker: str) -> Admission:
    """A job handed off with its admission made ahead (budgets.handoff) starts: its claim completes
    and its slot becomes a running one. When the claim or the slot was lost meanwhile (held
    again, or reclaimed) the admission is undone and the job does not run here (reason None)."""
    if ledger.start_admitted(slot_id=claimed.slot_id, envelope=claimed.envelope, worker=worker):
        return Admission(claimed.slot_id, allowance_ms=claimed.reserved_ms)
    with transaction.atomic():
        lock(account_id=claimed.envelope.account, queue=queue)
        ledger.unadmit(slot_id=claimed.slot_id, account_id=claimed.envelope.account, queue=queue)
    return Admission(None)


def hold_counted(*, envelope: Envelope, queue: str, state: Standing, day: dt.date, reason: str,
                 eligible_at: dt.datetime) -> None:
    """Under the lock: put the job on hold, count the deferral on the account's day, and once the
    hold committed look whether what it waits for came meanwhile (`wake_when_committed`)."""
    hold_and_wake(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    usage_id = ledger.usage_id(state, account_id=envelope.account, queue=queue, day=day)
    UsageDay.objects.filter(pk=usage_id).update(deferrals=F("deferrals") + 1)


def hold_and_wake(*, envelope: Envelope, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put one job on hold and look, once that committed, whether what it waits for came meanwhile."""
    hold(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    wake_when_committed(account_id=envelope.account, queue=queue, reason=reason, eligible_at=eligible_at)


def wake_when_committed(*, account_id: int, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """A job held until a slot or budget is given back (due now): once its hold committed, look
    whether a settlement gave one back meanwhile without seeing the hold (settlements take no
    lock) and release what may go. No lost wake-ups: of the two looks, each made after its own
    commit (this one, and the settlement's), one sees the other's commit."""
    if eligible_at > clock.now():
        return  # it waits for a time (the next budget day, a back-off), not for a settlement
    if reason in (DeferReason.QUEUED_BEHIND, DeferReason.WORKERS_BUSY):
        # It waits behind older held work, which is released (and, when it ran, settled) under
        # the lock or by a settlement that sees this hold: whoever frees a slot for it sees it.
        # Or for a worker, all of them busy: each one's settlement pulls from the lines once the
        # broker's job started, and an idle worker's pulse releases what it finds.
        return
    transaction.on_commit(lambda: release_if_ready(account_id=account_id, queue=queue), robust=True)
