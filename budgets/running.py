"""What a running slot does while its run goes on (budgets.watcher calls these every tick): renew
its lease and report its CPU, reserve more CPU when its allowance runs low, and, when its worker
was frozen past its lease and the slot was reclaimed meanwhile, take a free one again or stop."""
from django.db import transaction

from budgets import clock, ledger, standing
from budgets.locks import locked_standing
from budgets.models import Reservation, ReservationStatus


def reservation_renew(*, slot_id: int, cpu_ms: int) -> bool:
    """Report the run's CPU so far and renew its slot's lease; False when the slot is no longer
    the run's (reclaimed while its worker was frozen past its lease, or settled)."""
    return ledger.renew(slot_id=slot_id, cpu_ms=cpu_ms)


def reservation_grow(*, slot_id: int, cpu_ms: int, want_ms: int) -> int | None:
    """Reserve up to `want_ms` more CPU for a running slot from what its account has left today
    (under the lock); also renews the lease. Returns what was granted (0: the rest is used or
    reserved by other runs), None when the slot is no longer the run's."""
    slot = Reservation.objects.filter(pk=slot_id).values("account_id", "queue", "day").first()
    if slot is None:
        return None
    with transaction.atomic():
        state = locked_standing(account_id=slot["account_id"], queue=slot["queue"], day=slot["day"])
        grant = max(0, min(want_ms, state.unreserved_ms))
        usage_id = ledger.usage_id(state, account_id=slot["account_id"], queue=slot["queue"], day=slot["day"])
        if not ledger.grow(slot_id=slot_id, usage_id=usage_id, cpu_ms=cpu_ms, ms=grant):
            return None
    return grant


def retake_slot(*, slot_id: int) -> int | None:
    """The run's slot was reclaimed while its worker was frozen past its lease (the watcher found
    it gone when it woke): take it again if its account has a free slot and may start a job
    (ledger `revive`, under the lock: the job that took the slot meanwhile keeps it, and the cap
    holds). Returns what the run may now spend in all (CPU charged so far plus a step), or None:
    no free slot, or the slot was settled or is gone; then the run must stop."""
    slot = Reservation.objects.filter(pk=slot_id, status=ReservationStatus.RECLAIMED).values(
        "account_id", "queue", "day").first()
    if slot is None:
        return None
    with transaction.atomic():
        state = locked_standing(account_id=slot["account_id"], queue=slot["queue"], day=slot["day"])
        if standing.refusal(state, clock.now(), at_start=True, pause=True) is not None:
            return None  # it holds no slot now: it needs a free one
        step = standing.first_reservation_ms(state, 0)
        charged = ledger.revive(slot_id=slot_id, account_id=slot["account_id"], queue=slot["queue"], reserve_ms=step)
    return None if charged is None else charged + step
