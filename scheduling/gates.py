"""Enqueue gates: the checks account work passes before it is sent, and the source of the held work
a free worker runs next. Listed in FAIRSHARE["ENQUEUE_GATES"] (dotted paths, instantiated once),
like Django's AUTHENTICATION_BACKENDS; budgets.gate.BudgetGate is the default, after
scheduling.pausing.PauseGate. Gates see account work only.
"""
import datetime as dt
import functools
from typing import NamedTuple

from django.conf import settings
from django.utils.module_loading import import_string

from scheduling.context import Handoff, TaskContext
from scheduling.envelope import Envelope


class Wait(NamedTuple):
    """What held work waits for (a DeferReason) and from when it may go (None: no time is known)."""

    reason: str
    eta: dt.datetime | None


class EnqueueGate:
    """A gate. Every method has a default that lets everything through and takes nothing, so a
    gate implements only what it decides."""

    def admit(self, *, envelope: Envelope, queue: str) -> bool:
        """True when the job may go to the broker; False when it may not now, in which case the
        gate has put it in the holding area (`scheduling.holding.hold`)."""
        return True

    def admit_many(self, *, envelopes: list[Envelope], queue: str) -> list[bool]:
        """`admit` for a batch (`enqueue_many`), one verdict per envelope in order."""
        return [self.admit(envelope=envelope, queue=queue) for envelope in envelopes]

    def undo(self, *, envelope: Envelope, queue: str) -> None:
        """Give back what `admit` took when the job could not be sent after all."""

    def release_due(self, *, idle_workers: dict[str, int] | None = None) -> int:
        """Send held work whose time has come, as far as the gate allows (the worker pulse and the
        `scheduling.release_deferred` schedule call it); returns how many jobs went. With
        `idle_workers` (a worker's pulse: how many idle workers it speaks for, per queue) at most
        that many jobs per queue, in the gate's fair order; without, all that may go."""
        return 0

    def next_for(self, *, queue: str, worker: str, after: TaskContext) -> Handoff | None:
        """Work conservation: the held job `worker` runs next, claimed for it, after the run
        `after` (the gate's middleware may have handed that run's slot on already), or one it pulls
        in the gate's fair order into a free slot; None when there is none."""
        return None

    def worker_died(self, *, worker: str) -> int:
        """Give back at once what `worker` ("host:pid") held of the gate's (slots, claims on held
        work): it died, and none of its database sessions is left (scheduling.deaths). Idempotent;
        returns how many slots went back."""
        return 0

    def explain_lines(self, *, lines: set[tuple[int, str]]) -> dict[tuple[int, str], Wait]:
        """What each account's line (account id, queue) that the gate holds work in waits for now,
        and until when, for what anyone is shown of a held job (scheduling.waits); lines it says
        nothing of are left to the next gate, then to the reason each job was held for."""
        return {}


def enqueue_gates() -> tuple[EnqueueGate, ...]:
    return _load(tuple(settings.FAIRSHARE["ENQUEUE_GATES"]))


@functools.cache
def _load(paths: tuple[str, ...]) -> tuple[EnqueueGate, ...]:
    return tuple(import_string(path)() for path in paths)
