"""Reads of the budgets app shared by the admin, the API, the commands and the jobs."""
import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q, QuerySet
from django.utils import timezone

from budgets import clock
from budgets.models import Account, Budget, Membership, Reservation, ReservationStatus, UsageDay


def membership_of(*, user, account: Account) -> Membership | None:
    if user is None or not user.is_authenticated:
        return None
    return Membership.objects.filter(user=user, account=account).first()


def can_export(*, user, account: Account) -> bool:
    """Superusers may export any account; others need an exporting role in it."""
    if user is None or not user.is_active:
        return False
    if user.is_superuser:
        return True
    membership = membership_of(user=user, account=account)
    return membership is not None and membership.can_export


def accounts_visible_to(*, user) -> QuerySet[Account]:
    if user.is_superuser:
        return Account.objects.all()
    return Account.objects.filter(memberships__user=user)


def refs_in_flight(*, job: str, sent_since: dt.datetime) -> QuerySet[str]:
    """Refs of `job` that hold a live slot: running with a lease that has not expired, or sent to
    the broker (dispatched) at or after `sent_since` and not started yet.

    A reclaimed slot (its worker died) and a run whose lease expired are not in flight, whatever
    is left of their rows: the work they carried needs its doorbell rung again.
    """
    now = timezone.now()
    # A dispatched slot's lease runs DISPATCH_LEASE_S from when it was sent (or last re-sent).
    sent_lease_cutoff = sent_since + dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])
    return Reservation.objects.filter(
        Q(status=ReservationStatus.ACTIVE, lease_expires_at__gte=now)
        | Q(status=ReservationStatus.DISPATCHED, lease_expires_at__gte=sent_lease_cutoff),
        job=job,
    ).values_list("ref", flat=True)


@dataclass(frozen=True)
class BudgetStatus:
    account: str
    queue: str
    day: dt.date
    cpu_limit_ms: int
    cpu_used_ms: int
    cpu_reserved_ms: int
    running: int
    sent: int  # in the broker, not started: each holds a slot too
    max_concurrent: int
    held: int
    next_reset: dt.datetime

    @property
    def cpu_remaining_ms(self) -> int:
        return max(0, self.cpu_limit_ms - self.cpu_used_ms - self.cpu_reserved_ms)


def budget_status(*, accounts: QuerySet[Account] | None = None) -> list[BudgetStatus]:
    """Today's limit, use, reservations, running, sent and held work per account and queue."""
    from scheduling.models import DeferredTask

    day = clock.budget_day()
    accounts = (accounts if accounts is not None else Account.objects.all()).order_by("slug")
    budgets = Budget.objects.filter(account__in=accounts).select_related("account").order_by("account__slug", "queue")
    usage = {(u.account_id, u.queue): u for u in UsageDay.objects.filter(account__in=accounts, day=day)}
    slots = Reservation.objects.filter(account__in=accounts)
    running = Counter(slots.filter(status=ReservationStatus.ACTIVE).values_list("account_id", "queue"))
    sent = Counter(slots.filter(status=ReservationStatus.DISPATCHED).values_list("account_id", "queue"))
    held = Counter(DeferredTask.objects.filter(account__in=accounts).values_list("account_id", "queue"))
    reset = clock.next_reset()
    rows = []
    for budget in budgets:
        key = (budget.account_id, budget.queue)
        used = usage.get(key)
        rows.append(BudgetStatus(
            account=budget.account.slug, queue=budget.queue, day=day,
            cpu_limit_ms=budget.cpu_seconds_per_day * 1000,
            cpu_used_ms=used.cpu_used_ms if used else 0, cpu_reserved_ms=used.cpu_reserved_ms if used else 0,
            running=running[key], sent=sent[key], max_concurrent=budget.max_concurrent, held=held[key], next_reset=reset,
        ))
    return rows
