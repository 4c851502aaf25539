"""The holding area (DeferredTask): work that may not run now waits here with its reason and the
time it becomes eligible, instead of in the broker. Only this module writes it.

Release = taking held work out of the holding area and sending it again; nothing else. A process
releases only work whose envelope version it speaks (`releasable`): parked messages of a newer
version (rolling upgrades) wait for an upgraded worker, whoever runs the release.
"""
import datetime as dt
import hashlib
import json
from typing import Any

from django.db import transaction
from django.db.models import F

from budgets.models import Account
from scheduling import clock
from scheduling.envelope import MAX_REF_LENGTH, Envelope, known_version
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import enqueue_gates, send_message, send_on_commit


def releasable():
    """Held work this process may release: of an envelope version it speaks."""
    return DeferredTask.objects.filter(envelope_version__lte=known_version())


def hold(*, envelope: Envelope, queue: str, reason: str, eligible_at: dt.datetime) -> None:
    """Put a job in the holding area (or refresh its reason if it is already held)."""
    # Duplicate deliveries of one envelope are held once: the (job, ref) constraint decides.
    held, created = DeferredTask.objects.get_or_create(
        job=envelope.job, ref=envelope.ref,
        defaults={"account_id": envelope.account, "queue": queue, "reason": reason, "eligible_at": eligible_at},
    )
    if not created:
        DeferredTask.objects.filter(pk=held.pk).update(
            reason=reason, eligible_at=eligible_at, deferrals=F("deferrals") + 1,
        )


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
        defaults={"reason": DeferReason.NEEDS_NEWER_WORKER, "envelope_version": version, "message": message},
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


def release_oldest(*, account_id: int, queue: str, limit: int) -> list[DeferredTask]:
    """Ring the doorbell again for the account's oldest due held jobs; returns them.

    Call it inside a transaction: the rows are locked (SKIP LOCKED, so concurrent callers take
    different ones) and sent once the caller commits.
    """
    if limit <= 0:
        return []
    due = list(
        releasable().select_for_update(skip_locked=True)
        .filter(account_id=account_id, queue=queue, eligible_at__lte=clock.now())
        .order_by("created_at", "id")[:limit]
    )
    _send_back(due)
    return due


def release_now(*, deferred_ids: list[int]) -> int:
    """An operator's release: back to the broker now, whatever the reason it was held."""
    with transaction.atomic():
        held = list(releasable().select_for_update(skip_locked=True).filter(pk__in=deferred_ids))
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
        due = releasable().select_for_update(skip_locked=True).filter(eligible_at__lte=clock.now())
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
            send_on_commit(job=task.job, account=task.account_id, ref=task.ref)
