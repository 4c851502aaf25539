"""A run's CPU allowance: the cooperative check, refills, and the OS backstop (RLIMIT_CPU).

A run may spend what its reservation holds in the usage ledger, no more. The reservation starts
at admission and is topped up while the account has budget left (budgets.middleware.Watcher
reserves more in the ledger, then calls `RunBudget.grow`); the runs of one account together can
never hold more than the account has left, so together they cannot overspend the daily cap.
"""
import math
import resource
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from scheduling.retries import MustWait


class BudgetExhausted(MustWait):
    """The account's daily CPU budget ran out during this run: not a failure, its job waits."""


class SlotLost(MustWait):
    """The run's slot was reclaimed while its worker was frozen past its lease, and none was free
    when it woke: it must not go on beside the job that took the slot; its job waits again."""


class RunBudget:
    """What a running task may still spend. Long jobs call `check()` between batches."""

    def __init__(self, allowance_ms: int, *, refill: Callable[[], None] | None = None):
        self.allowance_ms = allowance_ms
        # Asks for more (blocking briefly) when the allowance is spent; None: there is no more.
        self.refill = refill
        # Set when the account has no budget left to reserve: the run stops at its allowance.
        self.exhausted = False
        # Set when the run is over: a late SIGXCPU or refill no longer concerns it.
        self.finished = False
        # Set by the watcher when the run's slot is no longer its own (budgets.running): it stops.
        self.slot_lost = False
        self._cpu0 = time.process_time()
        self._rlimit_hard: int | None = None  # while cpu_limit() applies this allowance

    def used_ms(self) -> int:
        return round((time.process_time() - self._cpu0) * 1000)

    def remaining(self) -> int:
        return self.allowance_ms - self.used_ms()

    def grow(self, ms: int) -> None:
        """More CPU was reserved for this run: raise its allowance and its RLIMIT_CPU."""
        self.allowance_ms += ms
        self._apply_rlimit()

    def reset(self, allowance_ms: int) -> None:
        """The run's slot was reclaimed and taken again: what it may spend, in all, is now this."""
        self.allowance_ms = allowance_ms
        self._apply_rlimit()

    def check(self) -> None:
        if self.finished:
            return
        if self.slot_lost:
            raise SlotLost("its slot was reclaimed while its worker was frozen, and none is free")
        if self.remaining() > 0:
            return
        if not self.exhausted and self.refill is not None:
            self.refill()
            if self.remaining() > 0:
                return
        raise BudgetExhausted(f"daily CPU budget exhausted after {self.used_ms()} ms in this run")

    def _apply_rlimit(self) -> None:
        hard = self._rlimit_hard
        if hard is None:
            return
        # Whole seconds of process CPU time, rounded up: the handler below ignores early signals.
        limit = math.ceil(self._cpu0 + max(self.allowance_ms, 1) / 1000)
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))


@contextmanager
def cpu_limit(budget: RunBudget):
    """An OS backstop for jobs that never check their budget: SIGXCPU once the process has spent
    the run's allowance (whole seconds, rounded up), raised as BudgetExhausted in the task.

    django-q2 runs a task in its worker's main thread, where signal handlers run. The watcher
    thread raises the limit when it reserves more, and delivers the same signal itself
    (`_thread.interrupt_main`) as soon as the allowance is spent and no more can be had, so a job
    that never checks stops within a watcher tick rather than at the next whole second.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)

    def on_sigxcpu(signum, frame):
        # The kernel checks RLIMIT_CPU against its own tick-sampled CPU time, which can run ahead
        # of the process's real CPU time (by a quarter of a second and more on a VM with steal
        # time), and it raises the soft limit by a second when it signals, so it asks again later.
        # An early signal, or one for a run that has just finished, is ignored (check() returns).
        try:
            budget.check()
        except BudgetExhausted:
            raise BudgetExhausted(f"daily CPU budget exhausted after {budget.used_ms()} ms in this run "
                                  "(stopped by the CPU limit)") from None

    previous = signal.signal(signal.SIGXCPU, on_sigxcpu)
    budget._rlimit_hard = hard
    budget._apply_rlimit()
    try:
        yield
    finally:
        budget._rlimit_hard = None
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        signal.signal(signal.SIGXCPU, previous)
