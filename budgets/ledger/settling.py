"""A running slot's lease and its end: its watcher renews it (and grows its reservation); once it
expired the reclaim takes it back, and a run found alive may get it back (`revive`). The charge
(queries.sql `settle`) takes no lock: it only frees, and a job held at the same moment is not missed,
because both sides look again once they committed and one sees the other (budgets.admission
.wake_when_committed); its pass-on swaps one slot and its reservation for another.
"""
import datetime as dt

from django.conf import settings

from budgets import standing
from budgets.ledger.admitting import claim_params
from budgets.ledger.reads import QUERIES
from budgets.ledger.values import Charged, Claimed, PassOn
from budgets.models import Reservation, ReservationStatus
from scheduling import db
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.services import RunEnd

# What a settlement that does not pass its slot on gives for the pass-on's parameters.
NO_PASS_ON = PassOn(worker="", day=dt.date.min, lease_s=0)


def renew(*, slot_id: int, cpu_ms: int) -> bool:
    """ACTIVE -> ACTIVE: its CPU reported, its lease renewed; False when it is no longer ACTIVE."""
    return Reservation.objects.filter(pk=slot_id, status=ReservationStatus.ACTIVE).update(
        cpu_reported_ms=cpu_ms, lease_expires_at=standing.run_lease_expiry()) == 1


def grow(*, slot_id: int, usage_id: int, cpu_ms: int, ms: int) -> bool:
    """ACTIVE -> ACTIVE: `renew`, and `ms` more CPU reserved (the lock saw the account has it)."""
    return db.fetch_one(QUERIES["grow"], {"slot_id": slot_id, "usage_id": usage_id, "cpu_ms": cpu_ms, "ms": ms,
                                          "lease": standing.run_lease_expiry()}) is not None


def reclaim(*, slot: Reservation, charge_ms: int) -> None:
    """ACTIVE -> RECLAIMED: its lease expired; charged `charge_ms` (what it reported)."""
    db.fetch_one(QUERIES["reclaim"], {"slot_id": slot.pk, "charge_ms": charge_ms})


def revive(*, slot_id: int, account_id: int, queue: str, reserve_ms: int) -> int | None:
    """RECLAIMED -> ACTIVE: its frozen worker woke to a free slot; its CPU charged (None: not reclaimed)."""
    row = db.fetch_one(QUERIES["revive"], {"slot_id": slot_id, "reserve_ms": reserve_ms,
                                           "lease": standing.run_lease_expiry()})
    return None if row is None else row["cpu_charged_ms"]


def charge(*, slot_id: int, account_id: int, queue: str, meter: Meter, cap_hit: bool, end: RunEnd,
           now: dt.datetime, pass_on: PassOn | None = None) -> Charged | None:
    """ACTIVE (or DISPATCHED, RECLAIMED) -> (none), charged and recorded on its run (`end`), with
    `pass_on` passed on when it may; None when it was settled already (exactly once)."""
    step, carry_s = settings.FAIRSHARE["RESERVATION_STEP_MS"], settings.FAIRSHARE["CHARGE_CARRY_S"]
    passing = pass_on or NO_PASS_ON
    run = TaskRun(account_id=account_id, queue=queue, worker=passing.worker)
    ended = end.params()  # its end first: the run it passes its slot on to starts after it
    claim = claim_params(run=run, now=now, lease_s=passing.lease_s)
    row = db.fetch_one(QUERIES["settle"], {
        **ended, **claim, "slot_id": slot_id, "account_id": account_id, "queue": queue, "cpu_ms": meter.cpu_ms,
        "wall_ms": meter.wall_ms, "db_wait_ms": round(meter.db_wait_ms), "storage_wait_ms": round(meter.storage_wait_ms),
        "cap_hits": 1 if cap_hit else 0, "pass_on": pass_on is not None, "today": passing.day, "step_ms": step,
        "keep_at_least": max(1, step // 2), "carry": carry_s > 0,
        "carry_since": claim["created_at"] - dt.timedelta(seconds=carry_s)})
    if row is None:
        return None
    passed = None
    if row["passed_job"] is not None:
        run.pk, run.job, run.ref = row["passed_run_id"], row["passed_job"], row["passed_ref"]
        passed = Claimed(Envelope(job=run.job, account=account_id, ref=run.ref, priority=row["passed_priority"]),
                         row["passed_slot_id"], run=run, reserved_ms=row["passed_reserved_ms"],
                         usage_id=row["usage_id"])
    return Charged(row["task_run_id"], row["status"] == ReservationStatus.ACTIVE, in_line=row["in_line"],
                   waiting=row["waiting"], others_waiting=row["others_waiting"], passed=passed)
