"""The usage ledger and the slots: every change to them is one transition of a slot, made by the
ledger backend chosen once (FAIRSHARE["LEDGER"], as Django picks a session engine).

A slot is a Reservation row; its states and the one transition (a method of the backend) that
moves it between them:

    (a job held)                                          (none)
        | claim_for / claim_and_admit (hand-off, pull)      | dispatch / dispatch_or_hold (enqueue)
        v                                                   v
    DISPATCHED on a claim's lease ── activate ──>  ACTIVE  <── activate (admission) ── DISPATCHED
    ACTIVE on a claim's lease ── start_admitted ──>  ACTIVE (running; the watcher renews its lease)
    ACTIVE ── charge (settlement; may pass the slot on: a new ACTIVE one for the next held job,
              which may carry the run's charge on: see budgets.ledger.settling) ──> (deleted)
    ACTIVE ── reclaim (lease expired: charged what it reported) ──> RECLAIMED ── charge of the rest ──> (deleted)
    RECLAIMED ── revive (its worker was only frozen, and a slot is free) ──> ACTIVE
    DISPATCHED ── undispatch (send failed) / reclaim (message lost) ──> (deleted)
    ACTIVE on a claim's lease ── unadmit (never started) ──> (deleted)
    ACTIVE ── renew (lease, CPU reported), grow (more CPU) ──> ACTIVE

Whatever ends a slot (charge, reclaim, unadmit) also charges what it carried: the figures of the
runs it was passed on from, whose CPU its day still holds as reserved.

Two backends pass the same behaviour tests, on PostgreSQL (tests/budgets/conftest.py runs the
ledger tests with each):
- budgets.ledger.portable.Ledger: the ORM, every transition that can refuse under the account's
  lock (SQLite, the demo's database, serialises its writers as a whole);
- budgets.ledger.postgresql.Ledger: the same transitions, those on a task's path one statement
  each (data-modifying WITH), some without the lock (its docstring says why each is safe).
"""
import datetime as dt
import functools
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.utils.module_loading import import_string

from scheduling.envelope import Envelope
from scheduling.models import TaskRun

DEFAULT_BACKENDS = {"postgresql": "budgets.ledger.postgresql.Ledger"}
PORTABLE = "budgets.ledger.portable.Ledger"


def ledger():
    """The ledger backend: FAIRSHARE["LEDGER"], else the one for this database."""
    path = settings.FAIRSHARE["LEDGER"] or DEFAULT_BACKENDS.get(connection.vendor, PORTABLE)
    return _load(path)


@functools.cache
def _load(path: str):
    return import_string(path)()


@dataclass(frozen=True)
class Charged:
    """What a settlement's charge did, and what it saw of the holding area while it did."""

    task_run_id: int | None
    was_active: bool  # it ran (admitted); else it was only dispatched or claimed
    in_line: bool  # the account has held work in its line on this queue
    waiting: bool  # some account's held work on the queue could go now (a free worker may pull it)
    others_waiting: bool = False  # another account's turn comes first: the freed slot goes by the fair order
    passed: "Claimed | None" = None  # the held job its slot was passed on to, admitted (`PassOn`)


@dataclass(frozen=True)
class PassOn:
    """Asks a settlement's charge to pass the run's slot on, in the same statement, to the first job
    of its account's line, claimed for `worker` and admitted with what the run left of its
    reservation; the PostgreSQL ledger does, when it may (else the slot is freed as without)."""

    worker: str
    day: dt.date  # today: a run charged to another day frees its slot instead
    lease_s: float


@dataclass(frozen=True)
class Claimed:
    """A held job claimed for a worker, with the slot taken for it: dispatched on the claim's
    lease, or (`run` set) admitted ahead: active, `reserved_ms` reserved on the day's usage row
    `usage_id`, its run recorded; it then only starts (`start_admitted`)."""

    envelope: Envelope
    slot_id: int
    run: TaskRun | None = None
    reserved_ms: int = 0
    usage_id: int | None = None

    @property
    def admitted(self) -> bool:
        return self.run is not None


@dataclass(frozen=True)
class AdmittedAtOnce:
    """What `admit_at_once` did: `slot_id` None when it admitted nothing (the caller then admits
    under the lock, which decides)."""

    slot_id: int | None
    paused: bool = False
