"""Writes of the budgets app: defaults, admission, settlement, reclaim and release."""
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
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
# Every write to an account's usage ledger and slots happens under the row lock of its Budget
# (account, queue): admission, settlement, reclaim and the enqueue-time check serialise per
# account and queue, so a slot freed by a settlement can never miss a job that a concurrent
# admission is just putting on hold (no lost wake-ups), and counts never drift.


@dataclass(frozen=True)
class Admission:
    reservation_id: int | None
    reason: str | None = None  # a DeferReason when refused
    eligible_at: dt.datetime | None = None
    allowance_ms: int = 0  # CPU this run may use before the daily cap stops it

    @property
    def admitted(self) -> bool:
        return self.reservation_id is not None


def _locked_budget(*, account_id: int, queue: str) -> Budget:
    budget = Budget.objects.select_for_update().filter(account_id=account_id, queue=queue).first()
    if budget is None:
        budgets_ensure_defaults(account=Account.objects.get(pk=account_id))
        budget = Budget.objects.select_for_update().get(account_id=account_id, queue=queue)
    return budget


def _usage(*, account_id: int, queue: str, day: dt.date) -> UsageDay:
    usage, _ = UsageDay.objects.get_or_create(account_id=account_id, queue=queue, day=day)
    return usage


def _running(*, account_id: int, queue: str) -> int:
    return Reservation.objects.filter(account_id=account_id, queue=queue, status=ReservationStatus.ACTIVE).count()


def _hold(*, envelope: Envelope, queue: str, usage: UsageDay, reason: str, eligible_at: dt.datetime) -> None:
    hold(envelope=envelope, queue=queue, reason=reason, eligible_at=eligible_at)
    UsageDay.objects.filter(pk=usage.pk).update(deferrals=F("deferrals") + 1)


def admit(*, envelope: Envelope, queue: str, estimate_ms: int, task_run_id: int | None, worker: str) -> Admission:
    """At the start of a run: take a slot and reserve CPU, or put the job on hold."""
    account_id = envelope.account
    with transaction.atomic():
        budget = _locked_budget(account_id=account_id, queue=queue)
        now = clock.now()
        usage = _usage(account_id=account_id, queue=queue, day=clock.budget_day(now))
        if _running(account_id=account_id, queue=queue) >= budget.max_concurrent:
            # Released as soon as one of the account's runs settles.
            _hold(envelope=envelope, queue=queue, usage=usage, reason=DeferReason.CONCURRENCY_CAP, eligible_at=now)
            return Admission(None, DeferReason.CONCURRENCY_CAP, now)
        remaining_ms = budget.cpu_seconds_per_day * 1000 - usage.cpu_used_ms - usage.cpu_reserved_ms
        if remaining_ms <= 0:
            reset = clock.next_reset(now)
            _hold(envelope=envelope, queue=queue, usage=usage, reason=DeferReason.BUDGET_EXHAUSTED, eligible_at=reset)
            return Admission(None, DeferReason.BUDGET_EXHAUSTED, reset)
        reserve_ms = min(estimate_ms, remaining_ms)
        UsageDay.objects.filter(pk=usage.pk).update(cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
        reservation = Reservation.objects.create(
            account_id=account_id, queue=queue, day=usage.day, job=envelope.job, ref=envelope.ref,
            task_run_id=task_run_id, worker=worker, cpu_reserved_ms=reserve_ms,
            lease_expires_at=timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["RESERVATION_LEASE_S"]),
        )
        if task_run_id is not None:
            # An admitted run is recorded from the moment it holds its slot (taken under the budget
            # lock, so after the settlement that freed the slot committed): the recorded runs of an
            # account never overlap more than its concurrency cap allows.
            TaskRun.objects.filter(pk=task_run_id).update(started_at=timezone.now())
    return Admission(reservation.pk, allowance_ms=remaining_ms)


def hold_at_enqueue(*, envelope: Envelope, queue: str) -> bool:
    """The enqueue-time check: hold the job instead of ringing the doorbell? Returns True if held.

    A job joins the holding area when its account is out of budget today, or already has work
    held on this queue (it waits behind it, first in first out). It is not reserved here: that
    happens when it starts.
    """
    with transaction.atomic():
        budget = _locked_budget(account_id=envelope.account, queue=queue)
        now = clock.now()
        usage = _usage(account_id=envelope.account, queue=queue, day=clock.budget_day(now))
        if usage.cpu_used_ms + usage.cpu_reserved_ms >= budget.cpu_seconds_per_day * 1000:
            _hold(envelope=envelope, queue=queue, usage=usage, reason=DeferReason.BUDGET_EXHAUSTED,
                  eligible_at=clock.next_reset(now))
            return True
        if DeferredTask.objects.filter(account_id=envelope.account, queue=queue).exists():
            _hold(envelope=envelope, queue=queue, usage=usage, reason=DeferReason.QUEUED_BEHIND, eligible_at=now)
            return True
    return False


def reservation_heartbeat(*, reservation_id: int, cpu_ms: int) -> None:
    """Called by a running task's heartbeat thread: report CPU so far and renew the lease."""
    Reservation.objects.filter(pk=reservation_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms,
        lease_expires_at=timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["RESERVATION_LEASE_S"]),
    )


def settle(
    *, reservation_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool = False,
    hold_envelope: Envelope | None = None,
) -> bool:
    """After a run: charge its measured CPU, release its reservation and slot, add its waits.

    Exactly once: the reservation row is deleted here, and a second settlement finds nothing.
    With `hold_envelope`, the job that hit the cap waits for the next budget day.
    """
    with transaction.atomic():
        _locked_budget(account_id=account_id, queue=queue)
        reservation = Reservation.objects.select_for_update().filter(pk=reservation_id).first()
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
        if hold_envelope is not None:
            now = clock.now()
            hold(envelope=hold_envelope, queue=queue, reason=DeferReason.BUDGET_EXHAUSTED, eligible_at=clock.next_reset(now))
        if was_active:
            release_oldest(account_id=account_id, queue=queue, limit=1)
    return True


def reclaim_expired() -> int:
    """Give back the slot and reservation of runs whose worker stopped heart-beating (it died).

    Charges the CPU they had reported, marks their TaskRun lost, and releases held work into the
    freed slot. Returns how many reservations it reclaimed.
    """
    reclaimed = 0
    expired = Reservation.objects.filter(status=ReservationStatus.ACTIVE, lease_expires_at__lt=timezone.now())
    for account_id, queue, pk in expired.values_list("account_id", "queue", "pk"):
        with transaction.atomic():
            _locked_budget(account_id=account_id, queue=queue)
            reservation = Reservation.objects.select_for_update().filter(
                pk=pk, status=ReservationStatus.ACTIVE, lease_expires_at__lt=timezone.now(),
            ).first()
            if reservation is None:  # it settled or renewed meanwhile
                continue
            charge = reservation.cpu_reported_ms
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
            release_oldest(account_id=account_id, queue=queue, limit=1)
            reclaimed += 1
    # A reclaimed run that really died never settles; forget it after a day.
    Reservation.objects.filter(
        status=ReservationStatus.RECLAIMED, lease_expires_at__lt=timezone.now() - dt.timedelta(days=1),
    ).delete()
    return reclaimed


def release_due() -> int:
    """Release held jobs whose time has come, as far as their account's free slots allow."""
    released = 0
    now = clock.now()
    pairs = (DeferredTask.objects.filter(eligible_at__lte=now)
             .values_list("account_id", "queue").distinct().order_by())
    for account_id, queue in pairs:
        with transaction.atomic():
            budget = _locked_budget(account_id=account_id, queue=queue)
            free = budget.max_concurrent - _running(account_id=account_id, queue=queue)
            if free > 0:
                released += release_oldest(account_id=account_id, queue=queue, limit=free)
    return released
