"""The transitions of a slot on a job's way to the broker: (none) -> DISPATCHED when it is sent,
back to (none) when it is held again or could not be sent. Under the account's lock (budgets.locks)
but `dispatch_or_hold`, the enqueue check's common case in one statement. Each writes or deletes the
job's own slot row by key.
"""
import datetime as dt

from django.utils import timezone

from budgets import standing
from budgets.ledger.reads import QUERIES, broker_window
from budgets.models import Reservation, ReservationStatus
from scheduling import clock, db
from scheduling.envelope import Envelope


def dispatch_or_hold(*, envelope: Envelope, queue: str, day: dt.date, workers_free: bool = True) -> bool | None:
    """(none) -> DISPATCHED without the lock (queries.sql `dispatch_or_hold`): True when the job
    took a slot, False when it joined the account's line; None when the lock must decide."""
    row = db.fetch_one(QUERIES["dispatch_or_hold"], {"workers_free": workers_free,
        "account_id": envelope.account, "queue": queue, "day": day, "job": envelope.job, "ref": envelope.ref,
        "priority": envelope.priority, "lease": standing.dispatch_lease_expiry(), "created_at": timezone.now(),
        "now": clock.now(), **broker_window()})
    return None if row is None else row["slot_id"] is not None


def dispatch_many(*, envelopes: list[Envelope], queue: str, day: dt.date, lease_s: float | None = None) -> list[int]:
    """(none) -> DISPATCHED: a slot for each job on its way to the broker (or claimed by a worker,
    for `lease_s`). Returns their ids."""
    expires = standing.dispatch_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
    return [slot.pk for slot in Reservation.objects.bulk_create([
        Reservation(account_id=e.account, queue=queue, day=day, job=e.job, ref=e.ref,
                    status=ReservationStatus.DISPATCHED, lease_expires_at=expires) for e in envelopes])]


def dispatch(*, envelope: Envelope, queue: str, day: dt.date, lease_s: float | None = None) -> int:
    """`dispatch_many` for one job."""
    (slot_id,) = dispatch_many(envelopes=[envelope], queue=queue, day=day, lease_s=lease_s)
    return slot_id


def redispatch(*, slot_id: int) -> None:
    """DISPATCHED -> DISPATCHED: the job is sent again before its message started (a reconciler's
    re-send), with a new dispatch lease."""
    Reservation.objects.filter(pk=slot_id).update(lease_expires_at=standing.dispatch_lease_expiry())


def drop(*, slot_id: int) -> None:
    """DISPATCHED -> (none): a sent or claimed job held again instead of admitted gives its slot back."""
    Reservation.objects.filter(pk=slot_id, status=ReservationStatus.DISPATCHED).delete()


def undispatch(*, envelope: Envelope, queue: str) -> None:
    """DISPATCHED -> (none): the job could not be sent after all (the broker refused it)."""
    dispatched = Reservation.objects.filter(account_id=envelope.account, queue=queue, job=envelope.job,
                                            ref=envelope.ref, status=ReservationStatus.DISPATCHED)
    Reservation.objects.filter(pk=dispatched.order_by("-pk").values_list("pk", flat=True).first()).delete()
