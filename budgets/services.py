"""Writes of the budgets app: defaults, admission, settlement, reclaim and release of held work.

Each takes the account's Budget row lock (budgets.standing explains why) before it changes the
usage ledger or the slots, but a settlement's charge: one statement of its own (`settle`).
"""
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, replace

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.utils import timezone

from budgets import clock, handoff, ledger, standing
from budgets.models import Account, Budget, Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling.envelope import Envelope
from scheduling.faults import fault_point
from scheduling.holding import eligible, hold
from scheduling.metering import Meter
from scheduling.models import DeferReason, DeferredTask, TaskRun
from scheduling.selectors import finished_run_cpu_ms
from scheduling.services import (
    task_run_finished_sql, task_run_mark_lost, task_run_mark_not_started, task_run_mark_started,
)


@transaction.atomic
def budgets_ensure_defaults(*, account: Account) -> int:
    """Give the account its plan tier's budget on every queue it has none for; returns how many."""
    created = 0
    for queue, limits in settings.FAIRSHARE["PLAN_BUDGETS"][account.plan].items():
        # get_or_create relies on the (account, queue) unique constraint under concurrency.
        _, was_created = Budget.objects.get_or_create(account=account, queue=queue, defaults=limits)
        created += was_created
    return created


@dataclass(frozen=True)
class Admission:
    reservation_id: int | None
    reason: str | None = None  # a DeferReason when refused
    eligible_at: dt.datetime | None = None
    allowance_ms: int = 0  # the CPU reserved for this run: it stops there unless it can reserve more
    paused: bool = False  # a pause covered the job when it was admitted (scheduling.pausing)

    @property
    def admitted(self) -> bool:
        return self.reservation_id is not None


def _lock(*, account_id: int, queue: str) -> None:
    """Take the account's Budget row lock on this queue, creating its plan's defaults if it has none."""
    if not standing.lock(account_id=account_id, queue=queue):
        budgets_ensure_defaults(account=Account.objects.get(pk=account_id))
        if not standing.lock(account_id=account_id, queue=queue):
            raise Budget.DoesNotExist(f"account {account_id} has no budget on queue {queue!r}")


def _locked_state(
    *, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None, claim: str | None = None,
) -> Standing:
    _lock(account_id=account_id, queue=queue)
    return standing.read(account_id=account_id, queue=queue, day=day, envelope=envelope, claim=claim)


def _hold_and_wake(*, envelope: Envelope, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put one job on hold; once that committed, look whether what it waits for came meanwhile
    (`wake_when_committed`)."""
    hold(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    wake_when_committed(account_id=envelope.account, queue=queue, reason=reason, eligible_at=eligible_at)


def _hold(
    *, envelope: Envelope, queue: str, state: Standing, day: dt.date, reason: str, eligible_at: dt.datetime,
) -> None:
    _hold_and_wake(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    usage_id = standing.usage_id(state, account_id=envelope.account, queue=queue, day=day)
    UsageDay.objects.filter(pk=usage_id).update(deferrals=F("deferrals") + 1)


def admit(
    *, envelope: Envelope, queue: str, estimate_ms: int, worker: str, claim: str | None = None,
    run: TaskRun | None = None,
) -> Admission:
    """At the start of a run: take a slot and reserve CPU, or put the job on hold.

    A job sent by `admit_at_enqueue` (or released from the holding area, or claimed from it by
    `claim`, this worker: budgets.handoff) takes over the slot its dispatch holds; anything else
    (a duplicate delivery, an operator's release) needs a free one. A claimed job whose claim was
    lost (it expired and the job was released again) is not admitted: reason None, nothing held.
    An admitted run's record (`run`: inserted when not saved yet) is started in the same
    transaction as its slot.

    The common case — a job sent with a slot of its own, its account plainly below its caps —
    is one statement on PostgreSQL, without taking the lock first (`ledger.admit_at_once`);
    anything else is decided under the lock.
    """
    account_id = envelope.account
    if claim is None and run is not None and run.pk is None and connection.vendor == "postgresql":
        reserve_ms = standing.step_ms(estimate_ms)
        at_once = ledger.admit_at_once(envelope=envelope, queue=queue, day=clock.budget_day(), reserve_ms=reserve_ms,
                                       run=run, worker=worker)
        if at_once.reservation_id is not None:
            return Admission(at_once.reservation_id, allowance_ms=reserve_ms, paused=at_once.paused)
    with transaction.atomic():
        now = clock.now()
        day = clock.budget_day(now)
        state = _locked_state(account_id=account_id, queue=queue, day=day, envelope=envelope, claim=claim)
        own = state.own_slot
        if claim is not None and not state.claimed:
            Reservation.objects.filter(pk=own).delete()  # its slot, if the reclaim has not taken it
            return Admission(None)
        # Without a slot of its own it needs a free one; with one, the cap on running jobs still
        # holds (two enqueues racing through the lock-free check may have dispatched one too many).
        if (own is None and state.free_slots <= 0) or state.active >= state.max_concurrent:
            if own is not None:
                Reservation.objects.filter(pk=own).delete()
            # Released as soon as one of the account's runs settles.
            _hold(envelope=envelope, queue=queue, state=state, day=day, reason=DeferReason.CONCURRENCY_CAP,
                  eligible_at=now)
            return Admission(None, DeferReason.CONCURRENCY_CAP, now)
        if state.unreserved_ms <= 0:
            if own is not None:
                Reservation.objects.filter(pk=own).delete()
            reason, eligible_at = standing.out_of_budget(state, now)
            _hold(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
            return Admission(None, reason, eligible_at)
        reserve_ms = standing.first_reservation_ms(state, estimate_ms)
        # An admitted run is recorded from the moment it holds its slot (taken under the budget
        # lock, so after the settlement that freed the slot committed): the recorded runs of an
        # account never overlap more than its concurrency cap allows.
        if run is not None and run.pk is not None:
            task_run_mark_started(run=run)
        # (It inserts a `run` not saved yet, and completes the claim.)
        own = ledger.take_slot(envelope=envelope, queue=queue, state=state, day=day, own=own, reserve_ms=reserve_ms,
                               run=run, worker=worker, claim=claim)
    return Admission(own, allowance_ms=reserve_ms, paused=state.paused)


def start_admitted(*, admitted: handoff.Admitted, envelope: Envelope, queue: str, worker: str) -> Admission:
    """A handed-off job admitted ahead with its claim (`handoff.hand_off`) starts: its claim
    completes and its slot becomes a running one (`ledger.start_claimed`). When the claim or the
    slot was lost meanwhile (held again, or reclaimed) the admission is undone and the job does
    not run here (reason None, as for any lost claim)."""
    if ledger.start_claimed(reservation_id=admitted.reservation_id, envelope=envelope, worker=worker):
        return Admission(admitted.reservation_id, allowance_ms=admitted.allowance_ms)
    with transaction.atomic():
        _lock(account_id=envelope.account, queue=queue)
        ledger.unadmit(reservation_id=admitted.reservation_id, account_id=envelope.account, queue=queue)
    return Admission(None)


def admit_at_enqueue(*, envelope: Envelope, queue: str) -> bool:
    """The enqueue-time check: may the job go to the broker? If so it takes a slot (dispatched);
    if not it joins the holding area. Returns True when the caller should send it.

    It is held when its account is out of budget today, has no free slot on this queue, or already
    has work held there (it waits behind it, first in first out). CPU is reserved when it starts.
    A job sent again while its first message has not started (a reconciler's re-send) goes out
    on the slot it already holds. The common case takes no lock and one statement: a job sent on
    a stale view is checked again when it starts.
    """
    now = clock.now()
    day = clock.budget_day(now)
    if standing.dispatch_if_free(envelope=envelope, queue=queue, day=day):
        return True
    state = standing.read(account_id=envelope.account, queue=queue, day=day, envelope=envelope)
    if state is not None and state.own_slot is not None:
        Reservation.objects.filter(pk=state.own_slot).update(lease_expires_at=standing.dispatch_lease_expiry())
        return True
    with transaction.atomic():
        state = _locked_state(account_id=envelope.account, queue=queue, day=day)
        if state.unreserved_ms <= 0:
            reason, eligible_at = standing.out_of_budget(state, now)
        elif state.held:
            reason, eligible_at = DeferReason.QUEUED_BEHIND, now
        elif state.free_slots <= 0:
            reason, eligible_at = DeferReason.CONCURRENCY_CAP, now
        else:
            standing.dispatch(envelope=envelope, queue=queue, day=day)
            return True
        _hold(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
    return False


def undispatch(*, envelope: Envelope, queue: str) -> None:
    """The job could not be sent after all (the broker refused it): give its slot back."""
    dispatched = Reservation.objects.filter(account_id=envelope.account, queue=queue, job=envelope.job,
                                            ref=envelope.ref, status=ReservationStatus.DISPATCHED)
    Reservation.objects.filter(pk=dispatched.order_by("-pk").values_list("pk", flat=True).first()).delete()


def reservation_renew(*, reservation_id: int, cpu_ms: int) -> None:
    """Called by a running task's watcher thread: report CPU so far and renew the lease."""
    Reservation.objects.filter(pk=reservation_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry())


def reservation_grow(*, reservation_id: int, cpu_ms: int, want_ms: int) -> int:
    """Reserve up to `want_ms` more CPU for a running task from what its account has left today;
    also renews the lease. Returns what was granted (0: the rest is used or reserved by other runs)."""
    reservation = Reservation.objects.filter(pk=reservation_id).values("account_id", "queue", "day").first()
    if reservation is None:
        return 0
    with transaction.atomic():
        state = _locked_state(account_id=reservation["account_id"], queue=reservation["queue"], day=reservation["day"])
        grant = max(0, min(want_ms, state.unreserved_ms))
        updated = Reservation.objects.filter(pk=reservation_id, status=ReservationStatus.ACTIVE).update(
            cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry(), cpu_reserved_ms=F("cpu_reserved_ms") + grant)
        if not updated or not grant:
            return 0
        UsageDay.objects.filter(pk=state.usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + grant)
    return grant


def settle(
    *, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool = False,
    envelope: Envelope | None = None, handoff_to: str | None = None, outcome: str | None = None, items: int = 0,
    error: BaseException | None = None, expect_held: bool = False, look_later: Callable[..., None] | None = None,
) -> handoff.Settled | None:
    """After a run: charge its measured CPU, free its reservation and slot, add its waits, and
    record the figures on its run (with how it ended, when `outcome` is given).

    Exactly once: the reservation row is deleted here, and a second settlement finds nothing (None).
    A run stopped by the cap (`cap_hit`, with its `envelope`) waits in the holding area: for the
    next budget day, or for budget its account's other runs give back. The freed slot goes to the
    account's oldest eligible held job: claimed for worker `handoff_to` when given (returned, to
    run next in that worker), else released to the broker.

    The charge is one statement and takes no lock (`ledger.charge`); only when work is held for
    the account (seen by that statement, or by a look once it committed) does the settlement take
    the lock to pass the slot on. A job put on hold meanwhile is not missed: a hold that waits for
    a slot or budget looks again once it committed (`wake_when_committed`), and of the two looks,
    each after its own commit, one sees the other's. With `look_later` (a worker's watcher, which
    makes the look for the settlements since its last tick: `release_if_held`) the settlement's
    look is left to it: it only matters for a hold that committed while the charge ran, and
    waits a tick at most. A run that came from the holding area
    (`expect_held`: its account most likely has more there) passes its slot on to the next held
    job in the charge's own statement when it may (PostgreSQL: `handoff.pass_on`, no lock either);
    elsewhere it settles under the lock, with what follows in the same transaction, as does a run
    stopped by the cap.
    """
    now = clock.now()
    day = clock.budget_day(now)

    def finished(run_id_sql: str) -> tuple[str, list]:
        return task_run_finished_sql(run_id_sql=run_id_sql, meter=meter, outcome=outcome, items=items, error=error)

    # A run that came from the holding area passes its slot on in its own settlement statement
    # (its account most likely has more held); others settle with the plain charge, which costs
    # less, and hand off under the lock when it finds work held (then the next run passes it on).
    pass_on = (handoff.pass_on(queue=queue, worker=handoff_to, day=day)
               if handoff_to is not None and expect_held else None)
    if (cap_hit and envelope is not None) or (expect_held and pass_on is None):
        return _settle_locked(reservation_id=reservation_id, account_id=account_id, queue=queue, meter=meter,
                              cap_hit=cap_hit, envelope=envelope, handoff_to=handoff_to, now=now, day=day,
                              finished=finished)
    # The run is recorded as finished in the statement that frees its slot: before any run that
    # takes the slot next is recorded as started.
    charged = ledger.charge(reservation_id=reservation_id, account_id=account_id, queue=queue, meter=meter,
                            cap_hit=cap_hit, now=now, finished=finished, pass_on=pass_on)
    if charged is None:
        return None
    if charged.passed is not None:
        fault_point("after_pass_on")
        return handoff.Settled(handoff=handoff.passed_on(charged.passed, account_id=account_id))
    claimed = None
    if charged.was_active and not charged.held and look_later is not None:
        look_later(account_id=account_id, queue=queue)
    elif charged.was_active and (charged.held or standing.held(account_id=account_id, queue=queue)):
        with transaction.atomic():
            state = _locked_state(account_id=account_id, queue=queue, day=day)
            claimed = _pass_on(account_id=account_id, queue=queue, state=state, day=day, handoff_to=handoff_to)
    return handoff.Settled(handoff=claimed, waiting=charged.waiting or claimed is not None)


def _settle_locked(
    *, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, envelope: Envelope | None,
    handoff_to: str | None, now: dt.datetime, day: dt.date, finished,
) -> handoff.Settled | None:
    """`settle` under the account's lock: the charge, a capped run's hold and the freed slot's
    hand-off in one transaction."""
    with transaction.atomic():
        _lock(account_id=account_id, queue=queue)
        charged = ledger.charge(reservation_id=reservation_id, account_id=account_id, queue=queue, meter=meter,
                                cap_hit=cap_hit, now=now, finished=finished, read_after=True)
        if charged is None:
            return None

        def standing_now() -> Standing:  # read with the charge where the database could
            if charged.after is not None and charged.day == day:
                return charged.after
            return standing.read(account_id=account_id, queue=queue, day=day)

        if cap_hit and envelope is not None:
            state = standing_now()
            if state.unreserved_ms > 0:  # its account's other runs left some: it may go on with that
                reason, eligible_at = DeferReason.BUDGET_RESERVED, now
            else:
                reason, eligible_at = standing.out_of_budget(state, now)
            _hold_and_wake(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
            state = replace(state, held=True)
        elif charged.was_active and charged.held:
            state = standing_now()
        else:
            state = None  # nothing held for this account: no slot to pass on, no state to read
        claimed = None
        if charged.was_active and state is not None:
            claimed = _pass_on(account_id=account_id, queue=queue, state=state, day=day, handoff_to=handoff_to)
    return handoff.Settled(handoff=claimed, waiting=charged.waiting or claimed is not None)


def _pass_on(*, account_id: int, queue: str, state: Standing, day: dt.date, handoff_to: str | None):
    """Under the lock: a freed slot goes to the account's oldest held job, claimed for worker
    `handoff_to` (returned) when given, else released to the broker."""
    claimed = None
    if handoff_to is not None:
        claimed = handoff.hand_off(account_id=account_id, queue=queue, state=state, day=day, worker=handoff_to)
    if claimed is None:
        handoff.release(account_id=account_id, queue=queue, state=state, limit=1, day=day)
    return claimed


def wake_when_committed(*, account_id: int, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """A job held until a slot or budget is given back (due now): once its hold committed, look
    whether a settlement gave one back meanwhile without seeing the hold (settlements take no
    lock, `settle`), and release what may go."""
    if eligible_at > clock.now():
        return  # it waits for a time (the next budget day, a back-off), not for a settlement
    if reason == DeferReason.QUEUED_BEHIND:
        # It waits behind older held work, which is released (and, when it ran, settled) under
        # the lock or by a settlement that sees this hold: whoever frees a slot for it sees it.
        return

    def wake() -> None:
        day = clock.budget_day()
        state = standing.read(account_id=account_id, queue=queue, day=day)
        if state is not None and handoff.releasable(state):
            _release_locked(account_id=account_id, queue=queue, day=day)

    transaction.on_commit(wake, robust=True)


def release_if_held(*, account_id: int, queue: str) -> int:
    """A settlement's look after its commit, made later (`settle`'s `look_later`): when anything
    of the account's is held on the queue, release what its free slots let go. Returns how many."""
    if not standing.held(account_id=account_id, queue=queue):
        return 0
    return _release_locked(account_id=account_id, queue=queue, day=clock.budget_day())


def _release_locked(*, account_id: int, queue: str, day: dt.date) -> int:
    with transaction.atomic():
        state = _locked_state(account_id=account_id, queue=queue, day=day)
        return handoff.release(account_id=account_id, queue=queue, state=state, day=day)


def reclaim_expired() -> int:
    """Give back the slots of runs that stopped renewing their lease (their worker died) and of
    dispatched jobs that never started (their message was lost).

    Charges the CPU a dead run had reported, marks its TaskRun lost, and releases held work into
    the freed slot. Returns how many slots it reclaimed.
    """
    reclaimed = 0
    expired = Reservation.objects.filter(status__in=standing.IN_FLIGHT, lease_expires_at__lt=timezone.now())
    for account_id, queue, pk in expired.values_list("account_id", "queue", "pk"):
        with transaction.atomic():
            day = clock.budget_day()
            _lock(account_id=account_id, queue=queue)
            # Its row locked: a settlement (which takes no Budget lock) of a run that was only slow
            # then waits for the reclaim and charges what the reclaim did not, or went first.
            reservation = Reservation.objects.select_for_update().filter(
                pk=pk, status__in=standing.IN_FLIGHT, lease_expires_at__lt=timezone.now(),
            ).first()
            if reservation is None:  # it settled, started or renewed meanwhile
                continue
            if reservation.status == ReservationStatus.DISPATCHED:
                reservation.delete()  # if the message turns up after all, admission checks it again
                # Its message was lost (Redis delivers at most once): the job waits in the holding
                # area to be sent again, so a lost message costs latency, never the job.
                _hold_and_wake(envelope=Envelope(job=reservation.job, account=account_id, ref=reservation.ref),
                               queue=queue, reason=DeferReason.MESSAGE_LOST, eligible_at=clock.now())
            elif _claim_held_by(reservation):
                # Admitted ahead with its claim (handoff.hand_off), and its worker died before it
                # started: undone, its run skipped, nothing charged or counted; the job, whose
                # claim expired with the slot, is released below.
                run_id = ledger.unadmit(reservation_id=pk, account_id=account_id, queue=queue,
                                        expired_before=timezone.now())
                if run_id is None:
                    continue  # it started meanwhile
                task_run_mark_not_started(run_id=run_id, reason="handed off to a worker that stopped before starting it")
            else:
                charge = _reclaim_charge(reservation)
                UsageDay.objects.filter(account_id=account_id, queue=queue, day=reservation.day).update(
                    cpu_used_ms=F("cpu_used_ms") + charge,
                    cpu_reserved_ms=F("cpu_reserved_ms") - reservation.cpu_reserved_ms,
                    runs=F("runs") + 1,
                )
                Reservation.objects.filter(pk=pk).update(status=ReservationStatus.RECLAIMED, cpu_charged_ms=charge)
                if reservation.task_run_id:
                    task_run_mark_lost(run_id=reservation.task_run_id, cpu_ms=charge,
                                       reason="the run stopped renewing its lease (its worker died)")
            state = standing.read(account_id=account_id, queue=queue, day=day)
            handoff.release(account_id=account_id, queue=queue, state=state, limit=1, day=day)
            reclaimed += 1
    # A reclaimed run that really died never settles; forget it after a day.
    Reservation.objects.filter(
        status=ReservationStatus.RECLAIMED, lease_expires_at__lt=timezone.now() - dt.timedelta(days=1),
    ).delete()
    return reclaimed


def _claim_held_by(reservation: Reservation) -> bool:
    """Whether the job of a running slot is still in the holding area, claimed by the slot's own
    worker: it was admitted ahead with its claim and never started."""
    return DeferredTask.objects.filter(job=reservation.job, ref=reservation.ref, claimed_by=reservation.worker).exists()


def _reclaim_charge(reservation: Reservation) -> int:
    """What a reclaimed run is charged: the CPU its TaskRun recorded when the run finished but could
    not settle (its connection was gone), else the CPU it last reported (its worker died)."""
    recorded = finished_run_cpu_ms(run_id=reservation.task_run_id) if reservation.task_run_id else None
    return max(reservation.cpu_reported_ms, recorded or 0)


def release_due() -> int:
    """Release held jobs whose time has come, as far as their account's free slots allow."""
    released = 0
    now = clock.now()
    day = clock.budget_day(now)
    pairs = (DeferredTask.objects.filter(eligible(now), account__isnull=False)  # account work only
             .values_list("account_id", "queue").distinct().order_by())
    for account_id, queue in pairs:
        released += _release_locked(account_id=account_id, queue=queue, day=day)
    return released
