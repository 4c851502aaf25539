"""The holding area (DeferredTask): work that may not run now waits here with its reason and the
time it becomes eligible, instead of in the broker. Only this module writes it.

Release = taking held work out of the holding area and sending it again; nothing else.
Claim = a worker takes a held job to run it itself, straight away, without a broker round trip
(a hand-off when its account's run settles, a pull when a worker has nothing else to do): the row
stays, marked with the worker and a lease, until that run starts (`claim_complete_sql`). A claim
whose lease expired (its worker died) is eligible again: the next release or claim takes it.

A process releases only work whose envelope version it speaks (`eligible`): messages parked for
a newer worker (rolling upgrades, `park`) wait for an upgraded one, whoever runs the release, and
are never claimed: they go back to the broker unchanged.
"""
import datetime as dt
import hashlib
import json
import logging
from typing import Any

from django.db import connection, transaction
from django.db.models import F, Q

from budgets.models import Account
from scheduling import clock
from scheduling.envelope import MAX_REF_LENGTH, Envelope, known_version
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import Handoff, close_old_connections, enqueue_gates, send_message, send_on_commit

logger = logging.getLogger("fairshare.tasks")


def hold(*, envelope: Envelope, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put a job in the holding area (or refresh its reason if it is already held)."""
    # Duplicate deliveries of one envelope are held once: the (job, ref) constraint decides.
    held, created = DeferredTask.objects.get_or_create(
        job=envelope.job, ref=envelope.ref,
        defaults={"account_id": envelope.account, "queue": queue, "reason": reason, "eligible_at": eligible_at,
                  "priority": envelope.priority},
    )
    if not created:
        # Held again: a claim on it is void (its claimant's admission then finds it lost and does
        # not run it), and it keeps its place in line.
        DeferredTask.objects.filter(pk=held.pk).update(
            reason=reason, eligible_at=eligible_at, deferrals=F("deferrals") + 1, claimed_by="", claim_expires_at=None,
        )


def hold_many(*, envelopes: list[Envelope], queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put a batch of jobs in the holding area with one insert, in their order (a job already
    held keeps its row as it is)."""
    DeferredTask.objects.bulk_create(
        [DeferredTask(account_id=e.account, queue=queue, job=e.job, ref=e.ref, reason=reason, eligible_at=eligible_at,
                      priority=e.priority) for e in envelopes],
        ignore_conflicts=True,
    )


def hold_scheduled(*, envelope: Envelope, queue: str, run_after: dt.datetime) -> None:
    """Hold work enqueued with a time before which it may not run (`enqueue(run_after=)`); the
    pulse releases it once that time has come, as any held work."""
    hold(envelope=envelope, queue=queue, reason=DeferReason.SCHEDULED, eligible_at=run_after)


def park(*, message: dict[str, Any], version: int, queue: str) -> DeferredTask:
    """Keep a message of a newer envelope version than this worker speaks, unchanged, until a worker
    that speaks it releases it. Keyed like held work by (job, ref), read as far as v1 can."""
    job, account, ref = message.get("job"), message.get("account"), message.get("ref")
    job = job[:100] if isinstance(job, str) and job else "(newer envelope)"
    if not isinstance(ref, str) or len(ref) > MAX_REF_LENGTH:  # a shape v1 cannot key: its digest
        ref = hashlib.sha256(json.dumps(message, sort_keys=True, default=str).encode()).hexdigest()
    valid_account = type(account) is int and Account.objects.filter(pk=account).exists()
    parked, _ = DeferredTask.objects.update_or_create(
        job=job, ref=ref,
        defaults={"reason": DeferReason.NEEDS_NEWER_WORKER, "envelope_version": version, "message": message,
                  "claimed_by": "", "claim_expires_at": None},
        create_defaults={"account_id": account if valid_account else None, "queue": queue,
                         "reason": DeferReason.NEEDS_NEWER_WORKER, "eligible_at": clock.now(),
                         "envelope_version": version, "message": message},
    )
    return parked


def unhold(*, job: str, ref: str) -> int:
    """Take a job out of the holding area without sending it (its work was cancelled); returns
    how many rows went (0 or 1)."""
    deleted, _ = DeferredTask.objects.filter(job=job, ref=ref).delete()
    return deleted


def eligible(now: dt.datetime) -> Q:
    """Held work that may go now: its time has come, no live claim covers it, and this process
    speaks its envelope version."""
    return (Q(eligible_at__lte=now) & (Q(claim_expires_at__isnull=True) | Q(claim_expires_at__lt=now))
            & Q(envelope_version__lte=known_version()))


# A claim: the account's oldest eligible held job (`eligible`'s condition; never a parked message:
# it goes back to the broker as it came), locked with SKIP LOCKED so two workers never claim the
# same job and one claiming job waits for no other, marked with its claimant and the claim's expiry.
_CLAIM_SQL = """
UPDATE {deferred} SET claimed_by = %s, claim_expires_at = %s
 WHERE id = (SELECT d.id FROM {deferred} d
              WHERE d.account_id = %s AND d.queue = %s AND d.message IS NULL AND d.envelope_version <= %s
                AND d.eligible_at <= %s AND (d.claim_expires_at IS NULL OR d.claim_expires_at < %s){unless}
              ORDER BY d.priority DESC, d.created_at, d.id LIMIT 1{lock})
RETURNING job, ref, priority
"""


def claim_oldest_sql(
    *, account_id: int, queue: str, worker: str, lease_s: float, unless: tuple[str, list] = ("", []),
) -> tuple[str, list]:
    """Claim the account's oldest eligible held job for `worker`, which will run it itself, unless
    the SQL condition `unless` holds: an UPDATE returning the job's (job, ref, priority), for a caller that
    sends it with the slot it takes for the job in one statement (budgets.handoff), inside its
    transaction."""
    now = clock.now()
    ops = connection.ops
    condition, condition_params = unless
    lock = " FOR UPDATE SKIP LOCKED" if connection.features.has_select_for_update_skip_locked else ""
    sql = _CLAIM_SQL.format(deferred=DeferredTask._meta.db_table, lock=lock,
                            unless=f" AND NOT {condition}" if condition else "")
    expires = ops.adapt_datetimefield_value(now + dt.timedelta(seconds=lease_s))
    now = ops.adapt_datetimefield_value(now)
    return sql, [worker, expires, account_id, queue, known_version(), now, now, *condition_params]


def claim_next(*, queue: str, worker: str) -> "Handoff | None":
    """Pull: a free worker asks the enqueue gates for held work of its queue (`next_for`), claimed
    for it in the gate's fair order; None when there is none (or the database is away)."""
    try:
        for gate in enqueue_gates():
            next_for = getattr(gate, "next_for", None)
            claimed = next_for(queue=queue, worker=worker) if next_for is not None else None
            if claimed is not None:
                return claimed
    except Exception as exc:  # e.g. the database went away: the message's own work is done; stop
        # here (raising would make django-q2 count the message as failed and deliver it again).
        logger.warning("pulling held work failed", extra={"error_class": type(exc).__name__})
        close_old_connections()
    return None


# Whether a worker still holds its claim on a job (`worker`: NULL when there is no claim, which
# matches nothing), as SQL for the state a run's admission reads (budgets.standing).
CLAIM_HELD_SQL = (f"EXISTS (SELECT 1 FROM {DeferredTask._meta.db_table} c "
                  "WHERE c.job = %s AND c.ref = %s AND c.claimed_by = %s)")


def claim_complete_sql(*, job: str, ref: str, worker: str) -> tuple[str, list]:
    """The claimed job's run is admitted: it leaves the holding area (a DELETE, for the caller to
    send with the slot it takes, budgets.ledger). Send it where the claim was seen held, under a
    lock that keeps others from taking it (the account's Budget row: every release and claim of
    its work takes that lock)."""
    return f"DELETE FROM {DeferredTask._meta.db_table} WHERE job = %s AND ref = %s AND claimed_by = %s", [job, ref, worker]


def release_oldest(*, account_id: int, queue: str, limit: int) -> list[DeferredTask]:
    """Ring the doorbell again for the account's oldest due held jobs; returns them.

    Call it inside a transaction: the rows are locked (SKIP LOCKED, so concurrent callers take
    different ones) and sent once the caller commits.
    """
    if limit <= 0:
        return []
    due = list(
        DeferredTask.objects.select_for_update(skip_locked=True)
        .filter(eligible(clock.now()), account_id=account_id, queue=queue)
        .order_by("-priority", "created_at", "id")[:limit]
    )
    _send_back(due)
    return due


def release_now(*, deferred_ids: list[int]) -> int:
    """An operator's release: back to the broker now, whatever the reason it was held."""
    with transaction.atomic():
        held = list(DeferredTask.objects.select_for_update(skip_locked=True)
                    .filter(pk__in=deferred_ids, envelope_version__lte=known_version()))
        _send_back(held)
    return len(held)


def release_due() -> int:
    """Release held work whose time has come (back-off over, new budget day, a freed slot).

    The enqueue gates decide how much of it may go (the budget gate: as many as each account has
    free slots); with no gate configured, all of it goes. Returns how many were released.
    """
    gates = enqueue_gates()
    released = sum(gate.release_due() for gate in gates)
    with transaction.atomic():
        # Gates see account work only: parked account-less messages go straight back.
        due = DeferredTask.objects.select_for_update(skip_locked=True).filter(eligible(clock.now()))
        due = list(due.filter(account__isnull=True) if gates else due)
        _send_back(due)
    return released + len(due)


def _send_back(held: list[DeferredTask]) -> None:
    """Take locked rows out of the holding area and ring the doorbell once the caller commits."""
    DeferredTask.objects.filter(pk__in=[task.pk for task in held]).delete()
    for task in held:
        # Sent straight to the broker: admission checks it again when it starts.
        if task.message is not None:  # a parked message goes back as it came
            message, queue, name, account = task.message, task.queue, f"{task.job}:{task.ref}", task.account_id
            transaction.on_commit(
                lambda m=message, q=queue, n=name, a=account: send_message(m, queue=q, name=n, account=a))
        else:
            send_on_commit(job=task.job, account=task.account_id, ref=task.ref, priority=task.priority)
