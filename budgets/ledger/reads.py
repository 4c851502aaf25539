"""What the ledger decides on: one account's lock and standing on a queue (what every rule of
budgets.standing decides on), its day's usage row, and the reads across accounts: the fair order
(`ready_accounts`), a job sent to the broker waiting for a worker (`broker_waiting`), the idle
workers. Their statements are queries.sql's (`QUERIES`, every ledger module's), which says what each
reads as held jobs and accounts grow, EXPLAINed in tests/scheduling/test_held_work_cost.py.
"""
import datetime as dt
from pathlib import Path

from django.db.models import Exists, OuterRef, Q
from django.utils import timezone

from budgets.ledger.values import Ready
from budgets.models import Queue, Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling import clock, db
from scheduling.liveness import running_workers

QUERIES = db.load_queries(Path(__file__).with_name("queries.sql"))
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


def broker_window() -> dict[str, dt.datetime]:
    """The statements' parameters `broker_forgets` < sent < `broker_since` of "a job sent to the
    broker waits for a worker"."""
    now = timezone.now()
    return {"broker_forgets": now - dt.timedelta(seconds=BROKER_WAIT_FORGET_S),
            "broker_since": now - dt.timedelta(seconds=BROKER_WAIT_YIELD_S)}


def may_take_over() -> Q:
    """Held jobs a release may take over once their claim expired: those whose claim's slot was
    given back (the rule fairshare_job_slots of budgets' migration 0012, for the ORM)."""
    slot = Reservation.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"), status__in=IN_FLIGHT,
                                      job=OuterRef("job"), ref=OuterRef("ref"))
    return Q(claim_expires_at__isnull=True) | ~Exists(slot)


def lock(*, account_id: int, queue: str) -> bool:
    """Lock the account's Budget row on the queue (in the caller's transaction, with a new version
    of the row, which `admit_at_once` checks); False when it has none."""
    return db.fetch_one(QUERIES["lock"], {"account_id": account_id, "queue": queue}) is not None


def standing(*, account_id: int, queue: str, day: dt.date, envelope=None, claimant: str | None = None) -> Standing | None:
    """The account's standing on the queue on `day` (after `lock`: exact until the commit); None
    without a Budget row. For a job (`envelope`) its own dispatched slot (then its slots taken are
    not counted), and whether `claimant` still holds its claim on it."""
    job, ref = (envelope.job, envelope.ref) if envelope is not None else ("", "")
    row = db.fetch_one(QUERIES["standing"], {
        "account_id": account_id, "queue": queue, "day": day, "job": job, "ref": ref, "claimant": claimant,
        "now": clock.now(), "wall_now": timezone.now()})
    if row is None:
        return None
    return Standing(**{**row, "rate_frees_at": clock.from_wall(row["rate_frees_at"])})


def usage_id(state: Standing, *, account_id: int, queue: str, day: dt.date) -> int:
    """The account's usage row for `day`, created on its first use."""
    if state.usage_id is not None:
        return state.usage_id
    usage, _ = UsageDay.objects.get_or_create(account_id=account_id, queue=queue, day=day)
    return usage.pk


def ready_accounts(*, queue: str | None, limit: int | None = None) -> list[Ready]:
    """Accounts whose line on the queue (None: each queue) could go now with a free slot, in fair
    order (weighted max-min fair: queries.sql `ready_accounts`)."""
    if queue is None:
        return [ready for q in Queue.values for ready in ready_accounts(queue=q, limit=limit)]
    with db.cursor() as cursor:
        cursor.execute(QUERIES["ready_accounts"], {"queue": queue, "limit": limit})
        return [Ready(account_id, queue, share) for account_id, share in cursor.fetchall()]


def broker_waiting(*, queue: str) -> bool:
    """Whether a job sent to the broker on the queue has waited BROKER_WAIT_YIELD_S without
    starting, and not yet BROKER_WAIT_FORGET_S."""
    return db.fetch_one(QUERIES["broker_waiting"], {"queue": queue, **broker_window()})["waiting"]


def idle_workers(*, queue: str) -> int | None:
    """How many more jobs the queue's workers could start now: its running workers less its slots
    taken. What may go to the broker at most, so that the rest waits in line in the fair order.
    None when workers run no pulse (nothing to count them by): then no such bound."""
    running = running_workers(queue=queue)
    if running is None:
        return None
    return max(0, running - Reservation.objects.filter(queue=queue, status__in=IN_FLIGHT).count())
