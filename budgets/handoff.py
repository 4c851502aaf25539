"""Where a freed slot goes: to the account's oldest held job, released to the broker
(`release`), or, for work conservation, claimed for a free worker that runs it without a broker
round trip.

Two ways to claim, both deciding under the account's Budget row lock (budgets.standing) and both
taking the job's slot (a DISPATCHED reservation, leased for FAIRSHARE["HANDOFF_CLAIM_LEASE_S"])
in the same transaction as the claim on the held row (scheduling.holding.claim_oldest_sql):

- hand-off: a settlement that frees a slot gives it to the same account's oldest eligible held
  job and returns it to the settling worker (`hand_off`, called inside `services.settle`);
- pull: a worker with nothing handed off claims another account's job into a free slot, in fair
  order (`pull`): accounts with the fewest slots in use first, then the one waiting longest.

The worker runs the claimed job at once (scheduling.runtime.execute); its admission takes over
the slot and completes the claim. If the worker dies first, the claim and the slot expire
together and the job is released again: nothing is lost, and a claimant that lost its claim
does not run the job, so nothing runs twice.
"""
import datetime as dt
from dataclasses import dataclass

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from budgets import clock, ledger, standing
from budgets.models import Budget, Reservation, ReservationStatus
from budgets.standing import Standing
from scheduling import db
from scheduling.envelope import Envelope
from scheduling.holding import claim_oldest_sql, release_oldest
from scheduling.registry import get_job
from scheduling.runtime import Handoff
from scheduling.services import task_run_new
from scheduling.models import DeferredTask

# A claimant yields to the broker (returns to django-q2) when a job sent to the broker on this
# queue has waited this long without starting: every worker is busy, and a worker that kept
# running held work would leave it waiting (up to a whole hand-off window). About two polls of
# FAIRSHARE_POLL's default, so a message an idle worker is about to fetch does not count.
BROKER_WAIT_YIELD_S = 0.25

# How many accounts a pull looks at before it gives up (each one it cannot use is skipped, e.g.
# its Budget row is locked by a settlement that is about to hand the slot off itself).
PULL_CANDIDATES = 4


@dataclass(frozen=True)
class Settled:
    """What a settlement returns (budgets.services.settle)."""

    handoff: Handoff | None = None  # the held job claimed for the settling worker
    waiting: bool = True  # held work on the queue may wait for a worker (False: a pull finds none)


def releasable(state: Standing) -> int:
    """How many of the account's held jobs its standing lets go now: none when nothing waits, or
    when it would only be held again until a run gives budget back; else its free slots."""
    if not state.held or (state.unreserved_ms <= 0 and state.active):
        return 0
    return max(0, state.free_slots)


def release(*, account_id: int, queue: str, state: Standing, day: dt.date, limit: int | None = None) -> int:
    """Send the account's oldest due held jobs into its free slots (each dispatched): as many as
    its standing lets go (`releasable`), at most `limit`."""
    limit = releasable(state) if limit is None else min(limit, releasable(state))
    if limit <= 0:
        return 0
    released = release_oldest(account_id=account_id, queue=queue, limit=limit)
    for held in released:
        standing.dispatch(envelope=Envelope(job=held.job, account=account_id, ref=held.ref, priority=held.priority),
                          queue=queue, day=day)
    return len(released)


@dataclass(frozen=True)
class Admitted:
    """A claimed job's admission, made ahead with its claim (`hand_off`): its slot, already
    active, and the CPU reserved for it. The job starts with `services.start_admitted`."""

    reservation_id: int
    allowance_ms: int


def hand_off(
    *, account_id: int, queue: str, state: Standing, day: dt.date, worker: str, yield_to_broker: bool = True,
) -> Handoff | None:
    """Under the account's lock, in the settling transaction or the one a settlement opens when it
    finds work held (budgets.services.settle): claim its oldest eligible held job for `worker`
    into the slot the settlement just freed, unless (`yield_to_broker`) a job sent to
    the broker on the queue waits for a worker: then the caller releases it to the broker instead,
    behind what waits there.

    The claimed job is admitted at once, in the same transaction (its slot made active, its CPU
    reserved, its run recorded as started), when its account's standing lets it in (not paused,
    below its cap on running jobs, budget left); it then only starts (`services.start_admitted`).
    The claim stays until the job starts: if `worker` dies first, the claim and the slot expire
    together and the reclaim undoes the admission and releases the job (nothing lost, no run
    counted). Otherwise its own admission decides when it starts, as for any claimed job."""
    # The same test as `release`: a job whose account has nothing left to reserve goes all the
    # same when none of its runs is active (its admission then holds it until the next day).
    if not state.held or state.free_slots <= 0 or (state.unreserved_ms <= 0 and state.active):
        return None  # nothing waits, or it would only be held again until a run gives budget back
    lease_s = settings.FAIRSHARE["HANDOFF_CLAIM_LEASE_S"]
    unless = (f"EXISTS ({_WAITING_IN_BROKER})", _waiting_params(queue)) if yield_to_broker else ("", [])
    claim = claim_oldest_sql(account_id=account_id, queue=queue, worker=worker, lease_s=lease_s, unless=unless)
    admissible = not state.paused and state.active < state.max_concurrent and state.unreserved_ms > 0
    if admissible and connection.vendor == "postgresql":  # claim and admit in one statement
        # It reserves a step (what the claim statement can know); a job that estimates more
        # reserves the rest once the claim says which job it is.
        step_ms = standing.first_reservation_ms(state, 0)
        claimed = ledger.claim_and_admit(claim=claim, account_id=account_id, queue=queue, state=state, day=day,
                                         worker=worker, reserve_ms=step_ms, lease_s=lease_s)
        if claimed is None:
            return None
        job, ref, priority, slot_id, run = claimed
        reserved = standing.first_reservation_ms(state, get_job(job).cpu_estimate_ms)
        if reserved > step_ms:
            ledger.reserve_more(reservation_id=slot_id, ms=reserved - step_ms,
                                usage_id=standing.usage_id(state, account_id=account_id, queue=queue, day=day))
        return Handoff(Envelope(job=job, account=account_id, ref=ref, priority=priority), run=run,
                       admission=Admitted(slot_id, reserved))
    with db.cursor() as cursor:
        if connection.vendor == "postgresql":  # the claim and its slot in one statement
            cursor.execute(*standing.dispatch_claimed_sql(claim=claim, account_id=account_id, queue=queue, day=day,
                                                          lease_s=lease_s))
            row = cursor.fetchone()
        else:
            cursor.execute(*claim)
            row = cursor.fetchone()
            if row is not None:
                slot = standing.dispatch(envelope=Envelope(job=row[0], account=account_id, ref=row[1]), queue=queue,
                                         day=day, lease_s=lease_s)
                row = (row[0], row[1], slot.pk, row[2])
    if row is None:
        return None
    envelope = Envelope(job=row[0], account=account_id, ref=row[1], priority=row[3])
    if not admissible:
        return Handoff(envelope)
    reserve_ms = standing.first_reservation_ms(state, get_job(envelope.job).cpu_estimate_ms)
    run = task_run_new(job=envelope.job, queue=queue, account_id=account_id, ref=envelope.ref)
    slot_id = ledger.take_slot(envelope=envelope, queue=queue, state=state, day=day, own=row[2], reserve_ms=reserve_ms,
                               run=run, worker=worker, lease_s=lease_s)
    return Handoff(envelope, run=run, admission=Admitted(slot_id, reserve_ms))


# A job sent to the broker on the queue waits for a worker: a dispatched slot older than
# BROKER_WAIT_YIELD_S (a claimed job's slot is not one: its held row is still there).
_WAITING_IN_BROKER = """
SELECT 1 FROM {reservation} r
 WHERE r.queue = %s AND r.status = %s AND r.created_at < %s
   AND NOT EXISTS (SELECT 1 FROM {deferred} d WHERE d.job = r.job AND d.ref = r.ref)
""".format(reservation=Reservation._meta.db_table, deferred=DeferredTask._meta.db_table)

# Accounts with eligible held work on a queue and a free slot there, fewest slots in use first,
# then the one whose oldest held job waited longest; none while work waits in the broker. One
# statement: it runs after every task that hands nothing off. (Budget rows of accounts with none yet get their defaults at admission,
# so an account without a Budget row is not pulled: its broker message or the pulse releases it.)
_CANDIDATES_SQL = """
SELECT d.account_id, MIN(d.created_at) AS oldest, b.max_concurrent,
       (SELECT COUNT(*) FROM {reservation} r
         WHERE r.account_id = d.account_id AND r.queue = %s AND r.status IN (%s, %s)) AS in_flight
  FROM {deferred} d
  JOIN {budget} b ON b.account_id = d.account_id AND b.queue = d.queue
 WHERE d.queue = %s AND d.eligible_at <= %s AND (d.claim_expires_at IS NULL OR d.claim_expires_at < %s)
 GROUP BY d.account_id, b.max_concurrent
""".format(reservation=Reservation._meta.db_table, deferred=DeferredTask._meta.db_table,
           budget=Budget._meta.db_table)
_FAIR_ORDER_SQL = f"""
SELECT account_id FROM ({_CANDIDATES_SQL}) c
 WHERE c.in_flight < c.max_concurrent AND NOT EXISTS ({_WAITING_IN_BROKER})
 ORDER BY c.in_flight, c.oldest LIMIT %s
"""


def _waiting_params(queue: str) -> list:
    """The parameters of _WAITING_IN_BROKER."""
    since = timezone.now() - dt.timedelta(seconds=BROKER_WAIT_YIELD_S)
    return [queue, ReservationStatus.DISPATCHED, connection.ops.adapt_datetimefield_value(since)]


def pass_on(*, queue: str, worker: str, day: dt.date) -> ledger.PassOn | None:
    """What a lock-free settlement needs to pass its slot on itself, in its own statement
    (`ledger.charge`), to the account's oldest eligible held job for `worker`: on PostgreSQL, and
    unless a job sent to the broker on the queue waits (as `hand_off`). None elsewhere: there the
    settlement hands off under the lock."""
    if connection.vendor != "postgresql":
        return None
    return ledger.PassOn(worker=worker, day=day, lease_s=settings.FAIRSHARE["HANDOFF_CLAIM_LEASE_S"],
                         unless=(f"EXISTS ({_WAITING_IN_BROKER})", _waiting_params(queue)))


def passed_on(passed: ledger.Passed, *, account_id: int) -> Handoff:
    """The job a settlement passed its slot on to, for its worker to run next (already admitted:
    it only starts, `services.start_admitted`). A job that estimates more than the slot kept
    reserves the rest when its account has that much left (else its watcher asks as it runs)."""
    reserved = passed.reserved_ms
    more = get_job(passed.job).cpu_estimate_ms - reserved
    if more > 0 and ledger.reserve_if_left(reservation_id=passed.reservation_id, usage_id=passed.usage_id, ms=more):
        reserved += more
    return Handoff(Envelope(job=passed.job, account=account_id, ref=passed.ref, priority=passed.priority), run=passed.run,
                   admission=Admitted(passed.reservation_id, reserved))


def pull(*, queue: str, worker: str) -> Handoff | None:
    """Claim one eligible held job of `queue` for `worker` into a free slot, in fair order."""
    now = clock.now()
    with db.cursor() as cursor:
        cursor.execute(_FAIR_ORDER_SQL, [queue, *standing.IN_FLIGHT, queue, now, now, *_waiting_params(queue),
                                         PULL_CANDIDATES])
        candidates = [row[0] for row in cursor.fetchall()]
    day = clock.budget_day(now)
    for account_id in candidates:
        with transaction.atomic():
            # SKIP LOCKED: an account whose lock is taken is being admitted or settled right now
            # (a settlement hands its own slot off); try the next instead of waiting.
            if not standing.lock(account_id=account_id, queue=queue, skip_locked=True):
                continue
            state = standing.read(account_id=account_id, queue=queue, day=day)
            claimed = hand_off(account_id=account_id, queue=queue, state=state, day=day, worker=worker,
                               yield_to_broker=False)  # (the candidates query looked)
        if claimed is not None:
            return claimed
    return None
