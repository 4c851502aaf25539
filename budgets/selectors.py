"""Reads of the budgets app shared by the admin, the API, the commands and the jobs."""
import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.db.models import Count, F, FilteredRelation, Q, QuerySet, Value
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce
from django.utils import timezone

from budgets import clock
from budgets.models import Account, Budget, Reservation, ReservationStatus
from scheduling.models import Backlog


def among(ids) -> RawSQL:
    """The right side of an `__in` for many account ids: one array parameter, not a placeholder per
    id (for 10,000 ids psycopg spends about 0.3 s converting a statement's placeholders)."""
    return RawSQL("SELECT unnest(%s::bigint[])", [sorted(ids)])


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
    weight: int = 1  # its share of busy workers against other accounts'
    rate_starts: int | None = None  # its rate limit: at most this many starts per rate_period_s
    rate_period_s: int = 60
    recent_starts: int = 0  # starts in the rate limit's window now (counted up to the limit)

    @property
    def cpu_remaining_ms(self) -> int:
        return max(0, self.cpu_limit_ms - self.cpu_used_ms - self.cpu_reserved_ms)

    @property
    def rate_full(self) -> bool:
        return self.rate_starts is not None and self.recent_starts >= self.rate_starts

    @property
    def rate(self) -> str:
        """How close it is to its rate limit: "starts / limit per period", or "" without one."""
        return "" if self.rate_starts is None else f"{self.recent_starts}/{self.rate_starts} per {self.rate_period_s} s"


def budget_status(*, accounts: QuerySet[Account] | None = None, top: int | None = None) -> list[BudgetStatus]:
    """Today's limit, use, reservations, running, sent and held work, weight and rate limit per
    account and queue, by account (slug); with `top`, only the `top` budgets that used the most CPU
    today. Four queries, whatever the number of accounts: the budgets with today's use, the slots of
    those, their held work (Backlog's counts, not the held jobs), and the rate-limited ones'
    windows (`_window_starts`)."""
    day = clock.budget_day()
    budgets = Budget.objects.filter(account__in=accounts if accounts is not None else Account.objects.all())
    # Today's use, joined by the unique index (account, queue, day): a join and not a sub-select
    # per budget, which a new day's first hours (statistics that know no row of today yet) could
    # plan as a scan of all of today's rows per budget, by the index on the day alone.
    budgets = budgets.annotate(today=FilteredRelation("account__usage_days", condition=Q(
        account__usage_days__queue=F("queue"), account__usage_days__day=day)))
    budgets = budgets.annotate(used=Coalesce("today__cpu_used_ms", Value(0)),
                               reserved=Coalesce("today__cpu_reserved_ms", Value(0)))
    budgets = budgets.order_by("-used", "account__slug", "queue")[:top] if top else budgets.order_by(
        "account__slug", "queue")
    rows = list(budgets.values("pk", "account_id", "account__slug", "queue", "cpu_seconds_per_day", "max_concurrent",
                               "used", "reserved", "weight", "rate_starts", "rate_period_s"))
    ids = {row["account_id"] for row in rows}
    slots = Counter()
    for account_id, queue, status, n in (Reservation.objects.filter(account_id__in=among(ids)).values_list(
            "account_id", "queue", "status").annotate(n=Count("pk")).order_by()):
        slots[(account_id, queue, status)] = n
    held = dict(((b["account_id"], b["queue"]), b["held"]) for b in
                Backlog.objects.filter(account_id__in=among(ids)).values("account_id", "queue", "held"))
    reset = clock.next_reset()
    starts = _window_starts(rows)
    return [BudgetStatus(
        account=row["account__slug"], queue=row["queue"], day=day, cpu_limit_ms=row["cpu_seconds_per_day"] * 1000,
        cpu_used_ms=row["used"], cpu_reserved_ms=row["reserved"],
        running=slots[(row["account_id"], row["queue"], ReservationStatus.ACTIVE)],
        sent=slots[(row["account_id"], row["queue"], ReservationStatus.DISPATCHED)],
        max_concurrent=row["max_concurrent"], held=held.get((row["account_id"], row["queue"]), 0), next_reset=reset,
        weight=row["weight"], rate_starts=row["rate_starts"], rate_period_s=row["rate_period_s"],
        recent_starts=starts.get((row["account_id"], row["queue"]), 0),
    ) for row in rows]


def _window_starts(rows: list[dict]) -> dict[tuple[int, str], int]:
    """Starts in the rate limit's window of each rate-limited budget among `rows`, counted up to its
    limit, in one statement (at most the limit's count of TaskRun index entries per budget,
    the SQL function fairshare_window of scheduling's migration 0023)."""
    limited = [row for row in rows if row["rate_starts"] is not None]
    if not limited:
        return {}
    with connection.cursor() as cursor:
        cursor.execute("SELECT b.account_id, b.queue, (SELECT COUNT(*) FROM fairshare_window("
                       "b.account_id, b.queue, b.rate_starts, b.rate_period_s, %(wall_now)s)) FROM budgets_budget b "
                       "WHERE b.id = ANY(%(ids)s) AND b.rate_starts IS NOT NULL",
                       {"ids": [row["pk"] for row in limited], "wall_now": timezone.now()})
        return {(account_id, queue): n for account_id, queue, n in cursor.fetchall()}
