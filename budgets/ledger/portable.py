"""The portable ledger: every slot transition through Django's ORM, on any database Django
supports. What can refuse work is decided under the account's lock (its Budget row, locked with
SELECT … FOR UPDATE; SQLite, which has no row locks, serialises its writers as a whole); the
settlement's charge, which only frees, locks only the slot it deletes. It takes more round trips
than the PostgreSQL ledger (a subclass that does the hot transitions in one statement each) and
behaves the same: the ledger tests run with both (tests/budgets/conftest.py).

Cost, as held jobs and accounts grow: every read is of one account's rows by index (its Budget,
its day's usage row, its slots, its line's first rows, its Backlog row); the reads across
accounts are budgets.ledger.order's.
"""
import datetime as dt

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from budgets import standing
from budgets.ledger import AdmittedAtOnce, Charged, Claimed, PassOn
from budgets.ledger.order import IN_FLIGHT, let_go
from budgets.ledger.reads import AccountReads
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.standing import Standing
from scheduling import claims, holding
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.services import (
    RunEnd, task_run_end, task_run_mark_running_again, task_run_mark_started, task_run_new,
)


class Ledger(AccountReads):
    """Every slot transition through the ORM (the reads it decides on: budgets.ledger.reads)."""

    # --- Slot transitions -----------------------------------------------------------------------

    def dispatch_or_hold(self, *, envelope: Envelope, queue: str, day: dt.date) -> bool | None:
        """The enqueue check's common case without the lock (an account with budget, a free slot and
        no rate limit): True when the job took a dispatched slot, False when it joined the
        account's line (behind its held work, or every worker being busy); None when the lock must
        decide. Here, always None."""
        return None

    def dispatch(self, *, envelope: Envelope, queue: str, day: dt.date, lease_s: float | None = None) -> int:
        """(none) -> DISPATCHED: a slot for a job on its way to the broker (or claimed by a worker,
        for `lease_s`). Under the account's lock."""
        expires = standing.dispatch_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
        return Reservation.objects.create(
            account_id=envelope.account, queue=queue, day=day, job=envelope.job, ref=envelope.ref,
            status=ReservationStatus.DISPATCHED, lease_expires_at=expires).pk

    def dispatch_many(self, *, envelopes: list[Envelope], queue: str, day: dt.date) -> None:
        """`dispatch` for a batch (enqueue_many)."""
        expires = standing.dispatch_lease_expiry()
        Reservation.objects.bulk_create([
            Reservation(account_id=e.account, queue=queue, day=day, job=e.job, ref=e.ref,
                        status=ReservationStatus.DISPATCHED, lease_expires_at=expires) for e in envelopes])

    def redispatch(self, *, slot_id: int) -> None:
        """DISPATCHED -> DISPATCHED: the job is sent again before its first message started (a
        reconciler's re-send) on the slot it holds, with a new dispatch lease."""
        Reservation.objects.filter(pk=slot_id).update(lease_expires_at=standing.dispatch_lease_expiry())

    def drop(self, *, slot_id: int) -> None:
        """DISPATCHED -> (none): a sent or claimed job held again instead of admitted gives its slot back."""
        Reservation.objects.filter(pk=slot_id, status=ReservationStatus.DISPATCHED).delete()

    def undispatch(self, *, envelope: Envelope, queue: str) -> None:
        """DISPATCHED -> (none): the job could not be sent after all (the broker refused it)."""
        dispatched = Reservation.objects.filter(account_id=envelope.account, queue=queue, job=envelope.job,
                                                ref=envelope.ref, status=ReservationStatus.DISPATCHED)
        Reservation.objects.filter(pk=dispatched.order_by("-pk").values_list("pk", flat=True).first()).delete()

    def admit_at_once(self, *, envelope: Envelope, queue: str, day: dt.date, reserve_ms: int, run: TaskRun,
                      worker: str) -> AdmittedAtOnce:
        """The admission's common case without the lock; here, never: the caller admits under it."""
        return AdmittedAtOnce(None)

    def activate(self, *, envelope: Envelope, queue: str, state: Standing, day: dt.date, own: int | None,
                 reserve_ms: int, run: TaskRun | None, worker: str, claimant: str | None = None,
                 lease_s: float | None = None) -> int:
        """DISPATCHED (its own, `own`) or (none) -> ACTIVE: reserve the run's CPU on its day, record
        the run as started (inserting a `run` not saved yet), and for a job claimed by `claimant`
        complete the claim. Its lease is a running slot's, or `lease_s` (admitted ahead with a
        claim: until it starts). Under the account's lock; returns the slot's id."""
        usage_id = self.usage_id(state, account_id=envelope.account, queue=queue, day=day)
        UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
        if claimant is not None:
            claims.complete_claim(job=envelope.job, ref=envelope.ref, worker=claimant)
        if run is not None:
            task_run_mark_started(run=run)
        lease = standing.run_lease_expiry() if lease_s is None else timezone.now() + dt.timedelta(seconds=lease_s)
        fields = {"status": ReservationStatus.ACTIVE, "day": day, "worker": worker, "cpu_reserved_ms": reserve_ms,
                  "lease_expires_at": lease, "task_run_id": run.pk if run is not None else None}
        if own is not None:
            Reservation.objects.filter(pk=own).update(**fields)
            return own
        return Reservation.objects.create(account_id=envelope.account, queue=queue, job=envelope.job,
                                          ref=envelope.ref, **fields).pk

    def charge(self, *, slot_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, end: RunEnd,
               now: dt.datetime, pass_on: PassOn | None = None) -> Charged | None:
        """ACTIVE (or DISPATCHED, RECLAIMED) -> (none): the settlement. Deletes the slot, charges
        the run's figures to its day (a reclaimed run only what the reclaim did not: its
        cpu_charged_ms) and records them on its run (`end`); None when it was settled already
        (exactly once). Atomic; takes no Budget lock: it only frees. `pass_on` is the PostgreSQL
        ledger's; here the caller hands the slot on under the lock."""
        with transaction.atomic():
            slot = Reservation.objects.select_for_update().filter(pk=slot_id).first()
            if slot is None:
                return None
            slot.delete()
            active = slot.status == ReservationStatus.ACTIVE
            _charge_day(slot, cpu_ms=max(0, meter.cpu_ms - slot.cpu_charged_ms),
                        reserved_ms=slot.cpu_reserved_ms if active else 0, runs=1 if active else 0,
                        wall_ms=meter.wall_ms, db_wait_ms=round(meter.db_wait_ms),
                        storage_wait_ms=round(meter.storage_wait_ms), cap_hits=1 if cap_hit else 0)
            if slot.task_run_id:
                task_run_end(run_id=slot.task_run_id, end=end)
        return Charged(slot.task_run_id, active, in_line=holding.in_line(account_id=account_id, queue=queue),
                       waiting=holding.any_ready(queue=queue),
                       others_waiting=self._others_first(account_id=account_id, queue=queue))

    def _others_first(self, *, account_id: int, queue: str) -> bool:
        """After a settlement (its slot deleted): whether another account's turn comes first (the
        PostgreSQL ledger's `others_ready`): a ready one with fewer slots in use for its weight."""
        weight = Budget.objects.filter(account_id=account_id, queue=queue).values_list("weight", flat=True).first() or 1
        mine = Reservation.objects.filter(account_id=account_id, queue=queue, status__in=IN_FLIGHT).count() / weight
        return any(ready.account_id != account_id and ready.share < mine
                   for ready in self.ready_accounts(queue=queue, limit=2))

    def claim_for(self, *, account_id: int, queue: str, day: dt.date, worker: str,
                  yield_to_broker: bool) -> Claimed | None:
        """(a held job) -> DISPATCHED on the claim's lease: claim the first job of the account's line
        for `worker` and take its slot, unless (`yield_to_broker`) a job sent to the broker waits.
        Under the account's lock."""
        if yield_to_broker and self.broker_waiting(queue=queue):
            return None
        held = claims.claim(account_id=account_id, queue=queue, worker=worker, lease_s=standing.claim_lease_s(),
                             let_go=let_go())
        if held is None:
            return None
        envelope = Envelope(job=held.job, account=account_id, ref=held.ref, priority=held.priority)
        return Claimed(envelope, self.dispatch(envelope=envelope, queue=queue, day=day, lease_s=standing.claim_lease_s()))

    def claim_and_admit(self, *, account_id: int, queue: str, state: Standing, day: dt.date, worker: str,
                        reserve_ms: int, yield_to_broker: bool) -> Claimed | None:
        """(a held job) -> ACTIVE on the claim's lease: `claim_for`, and the job admitted ahead:
        `reserve_ms` reserved, its run recorded. Under the account's lock, which saw the standing
        let it in."""
        if yield_to_broker and self.broker_waiting(queue=queue):
            return None
        lease_s = standing.claim_lease_s()
        held = claims.claim(account_id=account_id, queue=queue, worker=worker, lease_s=lease_s, let_go=let_go())
        if held is None:
            return None
        envelope = Envelope(job=held.job, account=account_id, ref=held.ref, priority=held.priority)
        run = task_run_new(job=envelope.job, queue=queue, account_id=account_id, ref=envelope.ref)
        slot_id = self.activate(envelope=envelope, queue=queue, state=state, day=day, own=None, reserve_ms=reserve_ms,
                                run=run, worker=worker, lease_s=lease_s)
        return Claimed(envelope, slot_id, run=run, reserved_ms=reserve_ms,
                       usage_id=self.usage_id(state, account_id=account_id, queue=queue, day=day))

    def start_admitted(self, *, slot_id: int, envelope: Envelope, worker: str) -> bool:
        """ACTIVE on a claim's lease -> ACTIVE (running): the job admitted ahead starts; its claim
        completes, if its slot is still there (locked, not written: the claim's lease runs until the
        run's watcher renews it, well before it ends: budgets.watcher). False when either is gone
        (the slot reclaimed, or the job held again, which voids a claim): it must not run."""
        with transaction.atomic():
            there = Reservation.objects.select_for_update().filter(pk=slot_id, status=ReservationStatus.ACTIVE).exists()
            return there and claims.complete_claim(job=envelope.job, ref=envelope.ref, worker=worker)

    def unadmit(self, *, slot_id: int, account_id: int, queue: str,
                expired_before: dt.datetime | None = None) -> int | None:
        """ACTIVE on a claim's lease -> (none): an admission whose run never started is undone, its
        CPU unreserved, nothing charged or counted; with `expired_before`, only if its lease is
        still expired then; what the slot carried of the runs it was passed on from is charged.
        Returns its run's id (None when nothing was undone)."""
        with transaction.atomic():
            slot = Reservation.objects.select_for_update().filter(
                Q(lease_expires_at__lt=expired_before) if expired_before else Q(),
                pk=slot_id, status=ReservationStatus.ACTIVE).first()
            if slot is None:
                return None
            slot.delete()
            _charge_day(slot, reserved_ms=slot.cpu_reserved_ms)
        return slot.task_run_id

    def renew(self, *, slot_id: int, cpu_ms: int) -> bool:
        """ACTIVE -> ACTIVE: a running slot reports its CPU and renews its lease; False when the slot
        is no longer the run's (it was reclaimed while its worker was frozen, or settled)."""
        return Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
            cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry()) == 1

    def grow(self, *, slot_id: int, usage_id: int, cpu_ms: int, ms: int) -> bool:
        """ACTIVE -> ACTIVE: `ms` more CPU reserved for a running slot, which also renews its lease;
        the caller (under the lock) decided the account has it. False when the slot is gone."""
        if not Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
                cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry(),
                cpu_reserved_ms=F("cpu_reserved_ms") + ms):
            return False
        if ms:
            UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + ms)
        return True

    def reserve_more(self, *, slot_id: int, usage_id: int, ms: int) -> None:
        """ACTIVE on a claim's lease -> the same: `ms` more reserved for a job admitted ahead whose
        estimate is larger than a step; under the lock, which saw the account has it."""
        UsageDay.objects.filter(pk=usage_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + ms)
        Reservation.objects.filter(pk=slot_id).update(cpu_reserved_ms=F("cpu_reserved_ms") + ms)

    def reclaim(self, *, slot: Reservation, charge_ms: int) -> None:
        """ACTIVE -> RECLAIMED: a run whose lease expired (its worker died, or froze) is charged
        `charge_ms` (what it reported) and its slot and reservation are given back; if it turns
        out to be alive after all, its settlement charges only the rest. What the slot carried of
        the runs it was passed on from is charged with it. Under the lock, `slot` read with its row
        locked."""
        _charge_day(slot, cpu_ms=charge_ms, reserved_ms=slot.cpu_reserved_ms, runs=1)
        Reservation.objects.filter(pk=slot.pk).update(status=ReservationStatus.RECLAIMED, cpu_charged_ms=charge_ms,
                                                      **NOTHING_CARRIED)

    def revive(self, *, slot_id: int, account_id: int, queue: str, reserve_ms: int) -> int | None:
        """RECLAIMED -> ACTIVE: the run of a slot reclaimed while its worker was frozen past its
        lease woke up, and its account has a free slot: the slot is its again, `reserve_ms`
        reserved, the run no longer counted twice (the reclaim counted it, its settlement will) nor
        marked lost. What the reclaim charged stays charged (its settlement charges the rest).
        Under the lock, which saw the free slot. Returns the slot's CPU charged so far, None when it
        is not reclaimed (it settled, or its row went)."""
        slot = Reservation.objects.select_for_update().filter(pk=slot_id, status=ReservationStatus.RECLAIMED).first()
        if slot is None:
            return None
        Reservation.objects.filter(pk=slot_id).update(status=ReservationStatus.ACTIVE, cpu_reserved_ms=reserve_ms,
                                                      lease_expires_at=standing.run_lease_expiry())
        UsageDay.objects.filter(account_id=account_id, queue=queue, day=slot.day).update(
            runs=F("runs") - 1, cpu_reserved_ms=F("cpu_reserved_ms") + reserve_ms)
        if slot.task_run_id:
            task_run_mark_running_again(run_id=slot.task_run_id)
        return slot.cpu_charged_ms

    def reserve_if_left(self, *, slot_id: int, usage_id: int, ms: int) -> bool:
        """`ms` more for a slot admitted ahead (a pass-on's job that estimates more than it kept),
        when its account has that much left; only the PostgreSQL ledger passes slots on."""
        raise NotImplementedError("the portable ledger does not pass slots on")


NOTHING_CARRIED = {"carried_runs": 0, "carried_cpu_ms": 0, "carried_wall_ms": 0, "carried_db_wait_ms": 0,
                   "carried_storage_wait_ms": 0, "carried_since": None}


def _charge_day(slot: Reservation, *, cpu_ms: int = 0, reserved_ms: int = 0, runs: int = 0, wall_ms: int = 0,
                db_wait_ms: int = 0, storage_wait_ms: int = 0, cap_hits: int = 0) -> None:
    """Charge the slot's day these figures (`reserved_ms` given back), and what the slot carried of
    the runs it was passed on from (the PostgreSQL ledger's pass-on: their CPU moves from reserved
    to used). Whatever ends a slot charges it so."""
    UsageDay.objects.filter(account_id=slot.account_id, queue=slot.queue, day=slot.day).update(
        cpu_used_ms=F("cpu_used_ms") + cpu_ms + slot.carried_cpu_ms,
        cpu_reserved_ms=F("cpu_reserved_ms") - reserved_ms - slot.carried_cpu_ms,
        runs=F("runs") + runs + slot.carried_runs, wall_ms=F("wall_ms") + wall_ms + slot.carried_wall_ms,
        db_wait_ms=F("db_wait_ms") + db_wait_ms + slot.carried_db_wait_ms,
        storage_wait_ms=F("storage_wait_ms") + storage_wait_ms + slot.carried_storage_wait_ms,
        cap_hits=F("cap_hits") + cap_hits)
