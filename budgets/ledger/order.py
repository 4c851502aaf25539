"""The fair order: which accounts' held work a free worker (or the pulse) takes next, and whether
work sent to the broker waits for a worker first. The portable forms (the ORM); the PostgreSQL
ledger writes `ready_accounts` as one statement of its own.

Cost, as held jobs and accounts grow: the Backlog rows of the accounts whose line could go now
(index backlog_ready, never the blocked ones, never the held jobs), each one's Budget, slots and
first held job; `broker_waiting` the slots sent more than a moment ago (index reservation_age).
"""
import datetime as dt

from django.db.models import Count, Exists, ExpressionWrapper, F, FloatField, IntegerField, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce
from django.utils import timezone

from typing import NamedTuple

from budgets.models import Budget, Reservation, ReservationStatus
from scheduling import holding, pausing
from scheduling.models import Backlog, DeferredTask

IN_FLIGHT = (ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE)
# A claimant yields to the broker when a job sent to the broker on its queue has waited this long
# without starting: every worker is busy, and one that kept running held work would leave it
# waiting. About two polls of FAIRSHARE_POLL's default, so a message an idle worker is about to
# fetch does not count.
BROKER_WAIT_YIELD_S = 0.25
# ... and no longer once it has waited this long: then its message was most likely lost (a killed
# worker's, with the Redis broker), and the reclaim sends it again at the end of its dispatch lease.
# Until then, work goes to the broker as if no job waited there, instead of waiting in line for
# workers that would yield to a message that never comes. A job that really waits this long waits
# behind long runs, which a work-conserving loop does not speed up.
BROKER_WAIT_FORGET_S = 60.0


def broker_window() -> tuple[dt.datetime, dt.datetime]:
    """The send times of the dispatched slots that say "a job sent to the broker waits for a
    worker": after the first, before the second."""
    now = timezone.now()
    return now - dt.timedelta(seconds=BROKER_WAIT_FORGET_S), now - dt.timedelta(seconds=BROKER_WAIT_YIELD_S)


def let_go() -> Q:
    """Held jobs a claim or a release may take over once their claim expired: those whose claim's
    slot was given back (statements.let_go says why; its SQL form)."""
    slot = Reservation.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"), status__in=IN_FLIGHT,
                                      job=OuterRef("job"), ref=OuterRef("ref"))
    return Q(claim_expires_at__isnull=True) | ~Exists(slot)


class Ready(NamedTuple):
    """An account whose line on `queue` could go now, and its `share`: slots in use per weight."""

    account_id: int
    queue: str
    share: float


class FairOrder:
    def ready_accounts(self, *, queue: str | None, limit: int | None = None) -> list[Ready]:
        """(account, queue) of accounts whose line could go now (holding.ready, not paused) and that
        have a free slot, in fair order: fewest slots in use for their weight first, then the one
        whose first held job has waited longest in line (weighted max-min fair)."""
        in_flight = (Reservation.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"),
                                                status__in=IN_FLIGHT)
                     .values("account_id").annotate(n=Count("pk")).values("n"))
        budget = Budget.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"))
        head = (DeferredTask.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"),
                                            in_line_since__isnull=False)
                .order_by(*holding.LINE_ORDER).values("in_line_since")[:1])
        ready = (Backlog.objects.filter(holding.ready(), **({"queue": queue} if queue else {}))
                 .exclude(pausing.covering_backlog())
                 .annotate(in_flight=Coalesce(Subquery(in_flight, output_field=IntegerField()), Value(0)),
                           cap=Subquery(budget.values("max_concurrent")), weight=Subquery(budget.values("weight")),
                           head=Subquery(head))
                 .filter(in_flight__lt=F("cap"))
                 .annotate(share=ExpressionWrapper(F("in_flight") * 1.0 / F("weight"), output_field=FloatField()))
                 .order_by("share", "head"))
        return [Ready(*row) for row in ready.values_list("account_id", "queue", "share")[:limit]]

    def broker_waiting(self, *, queue: str) -> bool:
        """Whether a job sent to the broker on the queue has waited BROKER_WAIT_YIELD_S without
        starting, and not yet BROKER_WAIT_FORGET_S (a claimed job's slot is not one: its held row
        is still there)."""
        forgets, since = broker_window()
        held = DeferredTask.objects.filter(job=OuterRef("job"), ref=OuterRef("ref"))
        return Reservation.objects.filter(queue=queue, status=ReservationStatus.DISPATCHED, created_at__lt=since,
                                          created_at__gt=forgets).exclude(Exists(held)).exists()

