"""A run's CPU allowance: the cooperative check and the OS backstop (RLIMIT_CPU)."""
import math
import resource
import signal
import threading
import time
from contextlib import contextmanager


class BudgetExhausted(Exception):
    """The account's daily CPU budget ran out during this run."""


class RunBudget:
    """What a running task may still spend. Long jobs call `check()` between batches."""

    def __init__(self, allowance_ms: int):
        self.allowance_ms = allowance_ms
        self._cpu0 = time.process_time()

    def used_ms(self) -> int:
        return round((time.process_time() - self._cpu0) * 1000)

    def remaining(self) -> int:
        return self.allowance_ms - self.used_ms()

    def check(self) -> None:
        if self.remaining() <= 0:
            raise BudgetExhausted(f"daily CPU budget exhausted after {self.used_ms()} ms in this run")


class UnlimitedBudget(RunBudget):
    def __init__(self):
        super().__init__(allowance_ms=0)

    def remaining(self) -> int:
        return math.inf

    def check(self) -> None:
        pass


@contextmanager
def cpu_limit(allowance_ms: int):
    """An OS backstop for jobs that never check their budget: SIGXCPU once the process has spent
    `allowance_ms` more CPU (whole seconds, rounded up), raised as BudgetExhausted in the task.
    django-q2 runs a task in its worker's main thread, where signal handlers run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    limit = math.ceil(usage.ru_utime + usage.ru_stime + max(allowance_ms, 1) / 1000)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    deadline = time.process_time() + max(allowance_ms, 1) / 1000

    def on_sigxcpu(signum, frame):
        # The kernel checks RLIMIT_CPU against its own tick-sampled CPU time, which can run ahead
        # of the process's real CPU time (by a quarter of a second and more on a VM with steal
        # time). Stopping then would hold the job until tomorrow with budget left over. The
        # kernel raised the soft limit by a second when it signalled, so it asks again later.
        if time.process_time() < deadline:
            return
        raise BudgetExhausted("daily CPU budget exhausted (RLIMIT_CPU)")

    previous = signal.signal(signal.SIGXCPU, on_sigxcpu)
    resource.setrlimit(resource.RLIMIT_CPU, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        signal.signal(signal.SIGXCPU, previous)
