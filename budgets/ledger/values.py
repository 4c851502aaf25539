"""What the ledger's transitions return: small typed values, read from their statements' results."""
import datetime as dt
from dataclasses import dataclass
from typing import NamedTuple

from scheduling.envelope import Envelope
from scheduling.models import TaskRun


@dataclass(frozen=True)
class Claimed:
    """A held job claimed for a worker and admitted ahead with its slot (ACTIVE on the claim's
    lease, its run recorded): it only starts."""

    envelope: Envelope
    slot_id: int
    run: TaskRun
    reserved_ms: int
    usage_id: int


@dataclass(frozen=True)
class Charged:
    """What a charge did, and what it saw of the holding area."""

    task_run_id: int | None
    was_active: bool  # it ran (admitted); else it was only dispatched
    in_line: bool  # the account has held work in its line on this queue
    waiting: bool  # some account's held work on the queue could go now (a free worker may pull it)
    others_waiting: bool = False  # another account's turn comes first: the freed slot goes by the fair order
    passed: Claimed | None = None  # the held job its slot was passed on to, admitted (`PassOn`)


@dataclass(frozen=True)
class PassOn:
    """Asks a charge to pass the slot on to the account's first held job, claimed for `worker`."""

    worker: str
    day: dt.date  # today: a run charged to another day frees its slot instead
    lease_s: float


class EnqueueCheck(NamedTuple):
    """What `dispatch_or_hold` did: sent (`decided` and a slot), held (`decided`, no slot), or left it
    to the lock (not `decided`); and whether a worker of the queue is free to start a job now."""

    decided: bool
    slot_id: int | None
    workers_free: bool


@dataclass(frozen=True)
class AdmittedAtOnce:
    """What `admit_at_once` did: `slot_id` None when it admitted nothing (the lock decides)."""

    slot_id: int | None
    paused: bool = False


class Ready(NamedTuple):
    """An account whose line on `queue` could go now, and its `share`: slots in use per weight."""

    account_id: int
    queue: str
    share: float
