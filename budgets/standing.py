"""An account's standing on one queue (its budget, today's usage, its slots, its held work) and the
rules every decision about it uses, written once, here, as arithmetic on the standing (read by
budgets.ledger under the account's lock, or within one statement). CPU is reserved in steps, only
from what the account has left, so its runs together cannot spend more than its daily cap.

A rate limit ("at most N starts in any P seconds") is a sliding window over the recorded starts
(TaskRun.started_at), at most N index entries (fairshare_window), chosen over GCRA: it keeps no state
of its own, and it is exact, as an operator (or a third-party quota) checks it. Starts are decided
under the lock, so two never take a window's last start both.
"""
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from budgets import clock
from scheduling.models import DeferReason
from scheduling.pausing import UNTIL_RESUMED


@dataclass(frozen=True)
class Standing:
    """An account's standing on one queue today."""

    cpu_limit_ms: int
    max_concurrent: int
    usage_id: int | None
    cpu_used_ms: int
    cpu_reserved_ms: int
    in_flight: int | None  # slots taken: dispatched or running (None: not counted, the job has a slot of its own)
    active: int  # running
    in_line: bool  # held work in the account's line on this queue (scheduling.holding)
    blocked: bool = False  # its line waits for a time: its budget was spent (scheduling.holding.block)
    own_slot: int | None = None  # the job's own dispatched slot, when asked for a job
    paused: bool = False  # a pause covers the account's work on this queue (scheduling.pausing)
    weight: int = 1  # its share of busy workers against other accounts' (budgets.ledger `ready_accounts`)
    rate_starts: int | None = None  # its rate limit: at most this many starts per rate_period_s (None: none)
    rate_period_s: int = 60
    recent_starts: int = 0  # runs started in the rate limit's window (counted up to rate_starts)
    rate_frees_at: dt.datetime | None = None  # when the oldest of those leaves the window (None: not full)

    @property
    def unreserved_ms(self) -> int:
        """What the account has left to reserve today: the rule "unreserved CPU"."""
        return self.cpu_limit_ms - self.cpu_used_ms - self.cpu_reserved_ms

    @property
    def free_slots(self) -> int:
        """Slots the account may still take on the queue: the rule "free slots"."""
        if self.in_flight is None:
            raise ValueError("slots were not counted: the standing was read for a job that holds a slot of its own")
        return self.max_concurrent - self.in_flight

    @property
    def rate_full(self) -> bool:
        """Whether its rate limit lets no run start now: the rule "rate limit reached"."""
        return self.rate_starts is not None and self.recent_starts >= self.rate_starts

    @property
    def starts_left(self) -> int | None:
        """Starts its rate limit has left, the jobs on their way counted as started (None: no limit)."""
        if self.rate_starts is None:
            return None
        on_their_way = 0 if self.in_flight is None else self.in_flight - self.active
        return max(0, self.rate_starts - self.recent_starts - on_their_way)


def refusal(state: Standing, now: dt.datetime, *, at_start: bool = False, line: bool = False,
            workers_busy: Callable[[], bool] | None = None, pause: bool = False) -> tuple[str, dt.datetime] | None:
    """Why the account's job may not go now, and from when (None: it may): the one rule, in one
    order, for every way in: paused (`pause`; else scheduling.pausing decides it), out of CPU budget,
    rate limited, at its cap, behind its line (`line`), workers busy (asked last: it reads the broker).
    At a run's start (`at_start`) the job holds a slot: the rate counts what started, the cap what runs."""
    if pause and state.paused:
        return DeferReason.PAUSED, UNTIL_RESUMED
    if state.unreserved_ms <= 0:
        return out_of_budget(state, now)
    if state.rate_full if at_start else state.starts_left == 0:
        # Until the oldest start in its window leaves it (or now: jobs on their way took the room).
        return DeferReason.RATE_LIMITED, max(now, state.rate_frees_at or now)
    if state.active >= state.max_concurrent or (
            not (at_start and state.own_slot is not None) and state.free_slots <= 0):
        return DeferReason.CONCURRENCY_CAP, now  # released as soon as one of the account's runs settles
    if line and state.in_line:
        return DeferReason.QUEUED_BEHIND, now
    if workers_busy is not None and workers_busy():
        return DeferReason.WORKERS_BUSY, now
    return None


def room(state: Standing) -> int:
    """How many more jobs may go now once `refusal` lets one: its free slots, at most the starts left."""
    free = max(0, state.free_slots)
    return free if state.starts_left is None else min(free, state.starts_left)


def releasable(state: Standing) -> int:
    """How many held jobs may go now: none if `refusal` holds them; else the `room`."""
    if not state.in_line or refusal(state, clock.now(), pause=True) is not None:
        return 0
    return room(state)


def step_ms(estimate_ms: int) -> int:
    """A step, or the job's estimate when larger."""
    return max(estimate_ms, settings.FAIRSHARE["RESERVATION_STEP_MS"])


def first_reservation_ms(state: Standing, estimate_ms: int) -> int:
    """What an admitted run reserves at first: `step_ms`, at most what its account has left."""
    return min(step_ms(estimate_ms), state.unreserved_ms)


def out_of_budget(state: Standing, now: dt.datetime) -> tuple[str, dt.datetime]:
    """Why an account with nothing left to reserve waits, and until when."""
    if state.active and state.unreserved_ms + state.cpu_reserved_ms > 0:
        # Its running jobs have reserved the rest; what they do not use comes back when they settle.
        return DeferReason.BUDGET_RESERVED, now
    return DeferReason.BUDGET_EXHAUSTED, clock.next_reset(now)


def run_lease_expiry() -> dt.datetime:
    """A running slot's lease: its watcher renews it; once it expires the slot is reclaimed."""
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["RESERVATION_LEASE_S"])


def dispatch_lease_expiry() -> dt.datetime:
    """A dispatched slot's lease: if its message has not started by then, it was lost."""
    return timezone.now() + dt.timedelta(seconds=settings.FAIRSHARE["DISPATCH_LEASE_S"])


def claim_lease_s() -> float:
    """How long a claimed job and the slot taken for it wait for its worker to start it."""
    return settings.FAIRSHARE["HANDOFF_CLAIM_LEASE_S"]
