"""Writes of the budgets app: defaults, admission, settlement, reclaim and release."""
import datetime as dt
from dataclasses import dataclass, replace

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F
from django.db.models.functions import Now
from django.utils import timezone

from budgets import clock
from budgets.metering import Meter
from budgets.models import Account, Budget, Reservation, ReservationStatus, UsageDay
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.services import hold, release_oldest


@transaction.atomic
def budgets_ensure_defaults(*, account: Account) -> int:
    """Give the account its plan tier's budget on every queue it has none for; returns how many."""
    created = 0
    for queue, limits in settings.FAIRSHARE["PLAN_BUDGETS"][account.plan].items():
        # get_or_create relies on the (account, queue) unique constraint under concurrency.
        _, was_created = Budget.objects.get_or_create(account=account, queue=queue, defaults=limits)
        created += was_created
    return created


# --- Admission, settlement, reclaim ----------------------------------------------------------
#
# Every write to an account's usage ledger and slots that can refuse or free work happens under
# the row lock of its Budget (account, queue): admission, settlement, reservation growth, reclaim
# and the enqueue-time check's slow path serialise per account and queue, so a slot freed by a
# settlement can never miss a job that a concurrent admission is just putting on hold (no lost
# wake-ups), and counts never drift.
#
# A slot is a Reservation row: DISPATCHED from the moment the job is sent to the broker until it
# starts, ACTIVE while it runs. CPU is reserved in steps (RESERVATION_STEP_MS, at least the job's
# estimate) and only from what the account has left, so its runs together cannot spend more than
# the daily cap however many run at once.

IN_FLIGHT = (ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE)


@dataclass(frozen=True)
class Admission:
    reservation_id: int | None
    reason: str | None = None  # a DeferReason when refused
    eligible_at: dt.datetime | None = None
    allowance_ms: int = 0  # the CPU reserved for this run: it stops there unless it can reserve more

    @property
    def admitted(self) -> bool:
        return self.reservation_id is not None


@dataclass(frozen=True)
class _State:
    """An account's standing on one queue today, read in one statement."""

    cpu_limit_ms: int
    max_concurrent: int
    usage_id: int | None
    cpu_used_ms: int
    cpu_reserved_ms: int
    in_flight: int  # slots taken: dispatched or running
    active: int  # running
    held: bool  # anything in the holding area on this queue
    own_slot: int | None = None  # the job's own dispatched Reservation, when asked for a job

    @property
    def unreserved_ms(self) -> int:
        return self.cpu_limit_ms - self.cpu_used_ms - self.cpu_reserved_ms

    @property
    def free_slots(self) -> int:
        return self.max_concurrent - self.in_flight


# One hand-written statement (for PostgreSQL and SQLite alike): it runs two or three times for
# every task, and building the same query through the ORM cost more CPU than running it.
_STATE_SQL = """
SELECT b.cpu_seconds_per_day, b.max_concurrent, u.id, COALESCE(u.cpu_used_ms, 0), COALESCE(u.cpu_reserved_ms, 0),
       (SELECT COUNT(*) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status IN (%s, %s)),
       (SELECT COUNT(*) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status = %s),
       EXISTS (SELECT 1 FROM {deferred} d WHERE d.account_id = b.account_id AND d.queue = b.queue),
       (SELECT MIN(r.id) FROM {reservation} r
         WHERE r.account_id = b.account_id AND r.queue = b.queue AND r.status = %s AND r.job = %s AND r.ref = %s)
  FROM {budget} b
  LEFT JOIN {usage} u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %s
 WHERE b.account_id = %s AND b.queue = %s
""".format(reservation=Reservation._meta.db_table, deferred=DeferredTask._meta.db_table,
           budget=Budget._meta.db_table, usage=UsageDay._meta.db_table)


def _state(*, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None) -> _State | None:
    """The budget, today's usage, the slots taken, whether work is held and (given an envelope)
    the slot that job was dispatched with, in one query.

    Run after the Budget row lock was taken (`_lock`), in a statement of its own, it sees
    everything committed before the lock was granted (READ COMMITTED: a new snapshot per statement).
    """
    job, ref = (envelope.job, envelope.ref) if envelope is not None else ("", "")
    with connection.cursor() as cursor:
        cursor.execute(_STATE_SQL, [
            ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE, ReservationStatus.ACTIVE,
            ReservationStatus.DISPATCHED, job, ref, day.isoformat(), account_id, queue,
        ])
        row = cursor.fetchone()
    if row is None:
        return None
    cpu_seconds, max_concurrent, usage_id, used, reserved, in_flight, active, held, own_slot = row
    return _State(cpu_limit_ms=cpu_seconds * 1000, max_concurrent=max_concurrent, usage_id=usage_id,
                  cpu_used_ms=used, cpu_reserved_ms=reserved, in_flight=in_flight, active=active,
                  held=bool(held), own_slot=own_slot if envelope is not None else None)


_LOCK_SQL = f"SELECT 1 FROM {Budget._meta.db_table} WHERE account_id = %s AND queue = %s"


def _lock(*, account_id: int, queue: str) -> None:
    """Lock the account's Budget row on this queue, creating its plan's defaults if it has none.
    (SQLite has no row locks: its transactions serialise writers as a whole.)"""
    sql = _LOCK_SQL + (" FOR UPDATE" if connection.features.has_select_for_update else "")
    with connection.cursor() as cursor:
        cursor.execute(sql, [account_id, queue])
        if cursor.fetchone() is not None:
            return
    budgets_ensure_defaults(account=Account.objects.get(pk=account_id))
    Budget.objects.select_for_update().get(account_id=account_id, queue=queue)


def _locked_state(*, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None) -> _State:
    _lock(account_id=account_id, queue=queue)
    return _state(account_id=account_id, queue=queue, day=day, envelope=envelope)


def _usage_id(state: _State, *, account_id: int, queue: str, day: dt.date) -> int:
    if state.usage_id is not None:
        return state.usage_id
    usage, _ = UsageDay.objects.get_or_create(account_id=account_id, queue=queue, day=day)
    return usage.pk


def _hold(
    *, envelope: Envelope, queue: str, state: _State, day: dt.date, reason: str, eligible_at: dt.datetime,
) -> None:
    hold(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    usage_id = _usage_id(state, account_id=envelope.account, queue=queue, day=day)
    UsageDay.objects.filter(pk=usage_id).update(deferrals=F("deferrals") + 1)


def _out_of_budget(state: _State, now: dt.datetime) -> tuple[str, dt.datetime]:
    """Why an account with nothing left to reserve waits, and until when."""
    if state.active and state.unreserved_ms + state.cpu_reserved_ms > 0:
        # Its running jobs have reserved the rest; what they do not use comes back when they settle.
        return DeferReason.BUDGET_RESERVED, now
    return DeferReason.BUDGET_EXHAUSTED, clock.next_reset(now)


def _lease() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["RESERVATION_LEASE_S"])


def _dispatch_lease() -> dt.datetime:
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])


def _dispatch(*, envelope: Envelope, queue: str, day: dt.date) -> Reservation:
    return Reservation.objects.create(
        account_id=envelope.account, queue=queue, day=day, job=envelope.job, ref=envelope.ref,
        status=ReservationStatus.DISPATCHED, lease_expires_at=_dispatch_lease(),
    )


def _release(*, account_id: int, queue: str, state: _State, limit: int, day: dt.date) -> int:
    """Send the account's oldest due held jobs into its free slots (each dispatched)."""
    if not state.held or (state.unreserved_ms <= 0 and state.active):
        return 0  # nothing waits, or it would only be held again until a run gives budget back
    released = release_oldest(account_id=account_id, queue=queue, limit=min(limit, state.free_slots))
    for held in released:
        _dispatch(envelope=Envelope(job=held.job, account=account_id, ref=held.ref), queue=queue, day=day)
    return len(released)


def admit(*, envelope: Envelope, queue: str, estimate_ms: int, task_run_id: int | None, worker: str) -> Admission:
    """At the start of a run: take a slot and reserve CPU, or put the job on hold.

    A job sent by `admit_at_enqueue` (or released from the holding area) takes over the slot its
    dispatch holds; anything else (a duplicate delivery, an operator's release) needs a free one.
    """
    account_id = envelope.account
    with transaction.atomic():
        now = clock.now()
        day = clock.budget_day(now)
        state = _locked_state(account_id=account_id, queue=queue, day=day, envelope=envelope)
        own = state.own_slot
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
            reason, eligible_at = _out_of_budget(state, now)
            _hold(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
            return Admission(None, reason, eligible_at)
        reserve_ms = min(max(estimate_ms, settings.FAIRSHARE["RESERVATION_STEP_MS"]), state.unreserved_ms)
        usage_id = _usage_id(state, account_id=account_id, queue=queue, day=day)
        UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
        slot = {
            "status": ReservationStatus.ACTIVE, "day": day, "task_run_id": task_run_id, "worker": worker,
            "cpu_reserved_ms": reserve_ms,
            "lease_expires_at": _lease(),
        }
        if own is not None:
            Reservation.objects.filter(pk=own).update(**slot)
        else:
            own = Reservation.objects.create(account_id=account_id, queue=queue, job=envelope.job, ref=envelope.ref,
                                             **slot).pk
        if task_run_id is not None:
            # An admitted run is recorded from the moment it holds its slot (taken under the budget
            # lock, so after the settlement that freed the slot committed): the recorded runs of an
            # account never overlap more than its concurrency cap allows.
            TaskRun.objects.filter(pk=task_run_id).update(started_at=timezone.now())
    return Admission(own, allowance_ms=reserve_ms)


def admit_at_enqueue(*, envelope: Envelope, queue: str) -> bool:
    """The enqueue-time check: may the job go to the broker? If so it takes a slot (dispatched);
    if not it joins the holding area. Returns True when the caller should send it.

    It is held when its account is out of budget today, has no free slot on this queue, or already
    has work held there (it waits behind it, first in first out). CPU is reserved when it starts.
    A job sent again while its first message has not started (a reconciler's re-send) goes out
    on the slot it already holds. The common case takes no lock: a job sent on a stale view is
    checked again when it starts.
    """
    now = clock.now()
    day = clock.budget_day(now)
    state = _state(account_id=envelope.account, queue=queue, day=day, envelope=envelope)
    if state is not None and state.own_slot is not None:
        Reservation.objects.filter(pk=state.own_slot).update(lease_expires_at=_dispatch_lease())
        return True
    if state is not None and state.unreserved_ms > 0 and state.free_slots > 0 and not state.held:
        _dispatch(envelope=envelope, queue=queue, day=day)
        return True
    with transaction.atomic():
        state = _locked_state(account_id=envelope.account, queue=queue, day=day)
        if state.unreserved_ms <= 0:
            reason, eligible_at = _out_of_budget(state, now)
        elif state.held:
            reason, eligible_at = DeferReason.QUEUED_BEHIND, now
        elif state.free_slots <= 0:
            reason, eligible_at = DeferReason.CONCURRENCY_CAP, now
        else:
            _dispatch(envelope=envelope, queue=queue, day=day)
            return True
        _hold(envelope=envelope, queue=queue, state=state, day=day, reason=reason, eligible_at=eligible_at)
    return False


def undispatch(*, envelope: Envelope, queue: str) -> None:
    """The job could not be sent after all (the broker refused it): give its slot back."""
    dispatched = Reservation.objects.filter(account_id=envelope.account, queue=queue, job=envelope.job,
                                            ref=envelope.ref, status=ReservationStatus.DISPATCHED)
    Reservation.objects.filter(pk=dispatched.order_by("-pk").values_list("pk", flat=True).first()).delete()


def reservation_heartbeat(*, reservation_id: int, cpu_ms: int) -> None:
    """Called by a running task's heartbeat thread: report CPU so far and renew the lease."""
    Reservation.objects.filter(pk=reservation_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms, lease_expires_at=_lease())


def reservation_grow(*, reservation_id: int, cpu_ms: int, want_ms: int) -> int:
    """Reserve up to `want_ms` more CPU for a running task from what its account has left today;
    also a heartbeat. Returns what was granted (0: the rest is used or reserved by other runs)."""
    reservation = Reservation.objects.filter(pk=reservation_id).values("account_id", "queue", "day").first()
    if reservation is None:
        return 0
    with transaction.atomic():
        state = _locked_state(account_id=reservation["account_id"], queue=reservation["queue"], day=reservation["day"])
        grant = max(0, min(want_ms, state.unreserved_ms))
        updated = Reservation.objects.filter(pk=reservation_id, status=ReservationStatus.ACTIVE).update(
            cpu_reported_ms=cpu_ms, lease_expires_at=_lease(), cpu_reserved_ms=F("cpu_reserved_ms") + grant)
        if not updated or not grant:
            return 0
        UsageDay.objects.filter(pk=state.usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + grant)
    return grant


def settle(
    *, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool = False,
    envelope: Envelope | None = None,
) -> bool:
    """After a run: charge its measured CPU, release its reservation and slot, add its waits.

    Exactly once: the reservation row is deleted here, and a second settlement finds nothing.
    A run stopped by the cap (`cap_hit`, with its `envelope`) waits in the holding area: for the
    next budget day, or for budget its account's other runs give back.
    """
    with transaction.atomic():
        now = clock.now()
        day = clock.budget_day(now)
        _lock(account_id=account_id, queue=queue)
        reservation = Reservation.objects.filter(pk=reservation_id).first()
        if reservation is None:
            return False
        was_active = reservation.status == ReservationStatus.ACTIVE
        if reservation.task_run_id:
            # ...and until it gives the slot back: before this transaction commits, so before
            # any run that takes the slot next is recorded as started.
            TaskRun.objects.filter(pk=reservation.task_run_id).update(finished_at=timezone.now())
        UsageDay.objects.filter(account_id=account_id, queue=queue, day=reservation.day).update(
            # A reclaimed run was already charged what it had reported; charge the rest.
            cpu_used_ms=F("cpu_used_ms") + max(0, meter.cpu_ms - reservation.cpu_charged_ms),
            cpu_reserved_ms=F("cpu_reserved_ms") - (reservation.cpu_reserved_ms if was_active else 0),
            wall_ms=F("wall_ms") + meter.wall_ms,
            db_wait_ms=F("db_wait_ms") + round(meter.db_wait_ms),
            storage_wait_ms=F("storage_wait_ms") + round(meter.storage_wait_ms),
            runs=F("runs") + (1 if was_active else 0),
            cap_hits=F("cap_hits") + (1 if cap_hit else 0),
        )
        reservation.delete()
        state = _state(account_id=account_id, queue=queue, day=day)
        if cap_hit and envelope is not None:
            if state.unreserved_ms > 0:  # its account's other runs left some: it may go on with that
                reason, eligible_at = DeferReason.BUDGET_RESERVED, now
            else:
                reason, eligible_at = _out_of_budget(state, now)
            hold(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
            state = replace(state, held=True)
        if was_active:
            _release(account_id=account_id, queue=queue, state=state, limit=1, day=day)
    return True


def reclaim_expired() -> int:
    """Give back the slots of runs whose worker stopped heart-beating (it died) and of dispatched
    jobs that never started (their message was lost).

    Charges the CPU a dead run had reported, marks its TaskRun lost, and releases held work into
    the freed slot. Returns how many slots it reclaimed.
    """
    reclaimed = 0
    expired = Reservation.objects.filter(status__in=IN_FLIGHT, lease_expires_at__lt=timezone.now())
    for account_id, queue, pk in expired.values_list("account_id", "queue", "pk"):
        with transaction.atomic():
            day = clock.budget_day()
            _lock(account_id=account_id, queue=queue)
            reservation = Reservation.objects.filter(
                pk=pk, status__in=IN_FLIGHT, lease_expires_at__lt=timezone.now(),
            ).first()
            if reservation is None:  # it settled, started or renewed meanwhile
                continue
            if reservation.status == ReservationStatus.DISPATCHED:
                reservation.delete()  # if the message turns up after all, admission checks it again
            else:
                charge = _reclaim_charge(reservation)
                UsageDay.objects.filter(account_id=account_id, queue=queue, day=reservation.day).update(
                    cpu_used_ms=F("cpu_used_ms") + charge,
                    cpu_reserved_ms=F("cpu_reserved_ms") - reservation.cpu_reserved_ms,
                    runs=F("runs") + 1,
                )
                Reservation.objects.filter(pk=pk).update(status=ReservationStatus.RECLAIMED, cpu_charged_ms=charge)
                if reservation.task_run_id:
                    TaskRun.objects.filter(pk=reservation.task_run_id, outcome=Outcome.RUNNING).update(
                        outcome=Outcome.LOST, cpu_ms=charge, finished_at=Now(),
                        error_class="WorkerLost", error_message="the worker stopped heart-beating; its lease expired",
                    )
            state = _state(account_id=account_id, queue=queue, day=day)
            _release(account_id=account_id, queue=queue, state=state, limit=1, day=day)
            reclaimed += 1
    # A reclaimed run that really died never settles; forget it after a day.
    Reservation.objects.filter(
        status=ReservationStatus.RECLAIMED, lease_expires_at__lt=timezone.now() - dt.timedelta(days=1),
    ).delete()
    return reclaimed


def _reclaim_charge(reservation: Reservation) -> int:
    """What a reclaimed run is charged: the CPU its TaskRun recorded when the run finished but could
    not settle (its connection was gone), else the CPU it last reported (its worker died)."""
    recorded = TaskRun.objects.filter(pk=reservation.task_run_id).exclude(outcome=Outcome.RUNNING) \
        .values_list("cpu_ms", flat=True).first() if reservation.task_run_id else None
    return max(reservation.cpu_reported_ms, recorded or 0)


def release_due() -> int:
    """Release held jobs whose time has come, as far as their account's free slots allow."""
    released = 0
    now = clock.now()
    day = clock.budget_day(now)
    pairs = (DeferredTask.objects.filter(eligible_at__lte=now)
             .values_list("account_id", "queue").distinct().order_by())
    for account_id, queue in pairs:
        with transaction.atomic():
            state = _locked_state(account_id=account_id, queue=queue, day=day)
            released += _release(account_id=account_id, queue=queue, state=state, limit=state.free_slots, day=day)
    return released
