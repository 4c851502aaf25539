"""What the ledger decides on: one account's lock and standing on a queue (what budgets.standing's
rules read), its day's usage row, the fair order (`ready_accounts`), the broker's waiting job and the
idle workers. Their statements are queries.sql's (`QUERIES`, every ledger module's), which says what
each reads as held jobs, accounts and history grow.
"""
import datetime as dt
from pathlib import Path

from django.utils import timezone

from budgets.ledger.values import Ready
from budgets.models import Queue, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling import clock, db
from scheduling.liveness import heard_since

QUERIES = db.load_queries(Path(__file__).with_name("queries.sql"))
IN_FLIGHT = (ReservationStatus.DISPATCHED, ReservationStatus.ACTIVE)
# A claimant yields to the broker when a job sent there waited this long without starting (every
# worker busy): about two polls, so a message about to be fetched does not count. And no longer
# once it waited this long: its message was most likely lost (a killed worker's, with Redis), and
# the reclaim sends it again; till then work would wait for workers yielding to nothing.
BROKER_WAIT_YIELD_S = 0.25
BROKER_WAIT_FORGET_S = 60.0


def broker_window() -> dict[str, dt.datetime]:
    """The statements' `broker_forgets` < sent < `broker_since` of "the broker's job waits"."""
    now = timezone.now()
    return {"broker_forgets": now - dt.timedelta(seconds=BROKER_WAIT_FORGET_S),
            "broker_since": now - dt.timedelta(seconds=BROKER_WAIT_YIELD_S)}


def lock(*, account_id: int, queue: str) -> bool:
    """Lock the account's Budget row (a new version: `admit_at_once` checks it); False without one."""
    return db.fetch_one(QUERIES["lock"], {"account_id": account_id, "queue": queue}) is not None


def standing(*, account_id: int, queue: str, day: dt.date, envelope=None) -> Standing | None:
    """The account's standing on `day` (after `lock`: exact until the commit); None without a Budget
    row. For a job (`envelope`) its own dispatched slot."""
    job, ref = (envelope.job, envelope.ref) if envelope is not None else ("", "")
    row = db.fetch_one(QUERIES["standing"], {
        "account_id": account_id, "queue": queue, "day": day, "job": job, "ref": ref, "now": clock.now(),
        "wall_now": timezone.now()})
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
    """Accounts whose line on the queue (None: each) could go now with a free slot, in fair order."""
    if queue is None:
        return [ready for q in Queue.values for ready in ready_accounts(queue=q, limit=limit)]
    rows = db.fetch_all(QUERIES["ready_accounts"], {"queue": queue, "limit": limit})
    return [Ready(row["account_id"], queue, row["share"]) for row in rows]


def broker_waiting(*, queue: str) -> bool:
    """Whether a job sent to the broker on the queue waits for a worker (`broker_window`)."""
    return db.fetch_one(QUERIES["broker_waiting"], {"queue": queue, **broker_window()})["waiting"]


def idle_workers(*, queue: str) -> int | None:
    """How many more jobs the queue's workers could start now (what may go to the broker at most):
    its running workers less its slots taken; None when workers run no pulse (no bound)."""
    since = heard_since()
    if since is None:
        return None
    return db.fetch_one(QUERIES["idle_workers"], {"queue": queue, "live_since": since})["idle"]
