"""One account's reads, the portable forms (the ORM): its lock, its standing on a queue (what every
rule of budgets.standing decides on) and its day's usage row. The PostgreSQL ledger does the lock
and the standing in one statement each (budgets/ledger/statements.py).

Cost, as held jobs and accounts grow: one account's rows by index (its Budget, its day's usage row,
its slots, bounded by its cap, its Backlog row, its claim by (job, ref)); a rate limit's window at
most the limit's count of TaskRun index entries. The reads across accounts are
budgets.ledger.order's.
"""
import datetime as dt

from django.utils import timezone

from budgets.ledger.order import IN_FLIGHT, FairOrder
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling import claims, clock, holding, pausing
from scheduling.envelope import Envelope
from scheduling.selectors import recent_starts


def _rate_window(*, account_id: int, queue: str, budget: dict) -> dict:
    """A rate-limited account's window: its starts counted (up to its limit) and when the oldest of
    a full window leaves it (on the kernel's clock)."""
    limit, period = budget["rate_starts"], dt.timedelta(seconds=budget["rate_period_s"])
    if limit is None:
        return {}
    starts = recent_starts(account_id=account_id, queue=queue, since=timezone.now() - period, limit=limit)
    return {"recent_starts": len(starts),
            "rate_frees_at": clock.from_wall(starts[-1] + period) if len(starts) >= limit else None}


class AccountReads(FairOrder):
    """The reads the portable ledger decides on (the PostgreSQL ledger has its own `lock` and
    `standing`), beside the fair order's."""

    def lock(self, *, account_id: int, queue: str) -> bool:
        """Lock the account's Budget row on the queue (in the caller's transaction); False when it
        has none."""
        rows = Budget.objects.select_for_update().filter(account_id=account_id, queue=queue)
        return rows.values_list("pk", flat=True).first() is not None

    def standing(self, *, account_id: int, queue: str, day: dt.date, envelope: Envelope | None = None,
                 claimant: str | None = None) -> Standing | None:
        """The account's standing on the queue on `day` (after `lock`: exact until the commit). For
        a job (`envelope`) its own dispatched slot, and whether `claimant` still holds its claim on
        it; the slots taken are not counted for a job that holds a slot of its own."""
        budget = Budget.objects.filter(account_id=account_id, queue=queue).values(
            "cpu_seconds_per_day", "max_concurrent", "weight", "rate_starts", "rate_period_s").first()
        if budget is None:
            return None
        usage = UsageDay.objects.filter(account_id=account_id, queue=queue, day=day).values(
            "pk", "cpu_used_ms", "cpu_reserved_ms").first() or {"pk": None, "cpu_used_ms": 0, "cpu_reserved_ms": 0}
        slots = Reservation.objects.filter(account_id=account_id, queue=queue)
        own = None
        if envelope is not None:
            own = (slots.filter(status=ReservationStatus.DISPATCHED, job=envelope.job, ref=envelope.ref)
                   .order_by("pk").values_list("pk", flat=True).first())
        return Standing(
            cpu_limit_ms=budget["cpu_seconds_per_day"] * 1000, max_concurrent=budget["max_concurrent"],
            usage_id=usage["pk"], cpu_used_ms=usage["cpu_used_ms"], cpu_reserved_ms=usage["cpu_reserved_ms"],
            in_flight=None if own else slots.filter(status__in=IN_FLIGHT).count(),
            active=slots.filter(status=ReservationStatus.ACTIVE).count(),
            in_line=holding.in_line(account_id=account_id, queue=queue),
            blocked=holding.blocked(account_id=account_id, queue=queue), own_slot=own,
            paused=pausing.covered(account_id=account_id, queue=queue),
            claimed=bool(envelope and claimant and claims.claim_held(job=envelope.job, ref=envelope.ref,
                                                                        worker=claimant)),
            weight=budget["weight"], rate_starts=budget["rate_starts"], rate_period_s=budget["rate_period_s"],
            **_rate_window(account_id=account_id, queue=queue, budget=budget),
        )

    def usage_id(self, state: Standing, *, account_id: int, queue: str, day: dt.date) -> int:
        """The account's usage row for `day`, created on its first use."""
        if state.usage_id is not None:
            return state.usage_id
        usage, _ = UsageDay.objects.get_or_create(account_id=account_id, queue=queue, day=day)
        return usage.pk
