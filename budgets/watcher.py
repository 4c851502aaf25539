"""The watcher: one thread per worker process, on its own database connection, looking after the
run in progress: its CPU allowance (more reserved as it runs low, the run stopped when none is
left), its slot's lease (taken again, or the run stopped, when it was reclaimed while the worker
was frozen), and the look after the settlements since its last tick."""
import _thread
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from django.conf import settings
from django.db import connections

from budgets import standing
from budgets.handoff import release_if_ready
from budgets.limits import RunBudget
from budgets.running import reservation_grow, reservation_renew, retake_slot

# How long a run that spent its allowance waits for the watcher thread to reserve more.
REFILL_WAIT_S = 10


@dataclass
class _Watched:
    """The run a watcher looks after, and what it has done for it."""

    slot_id: int
    budget: RunBudget
    interrupt_main: bool
    next_renew: float
    next_grow: float = 0.0


class Watcher(threading.Thread):
    """The worker process's companion thread, on its own database connection, watching the run in
    progress (django-q2 runs one task at a time in a worker process; the thread is started by the
    process's first run and lives as long as the process, so a run pays no thread start).

    Every tick it looks at the run's CPU: when the allowance runs low it reserves the next step
    from the account's remaining budget (`budgets.running.reservation_grow`); when there is none left and
    the allowance is spent, it stops the run with SIGXCPU (if the run is in the main thread, where
    `cpu_limit` handles it). Every RESERVATION_HEARTBEAT_S it reports the CPU used so far and
    renews the reservation's lease, so the slot of a run whose worker died is reclaimed once the
    lease expires. It also makes the look after the settlements since its last tick, once per
    account and queue (`look_again_later`, `budgets.handoff.release_if_ready`): each run's settlement spares
    that statement. Between runs, with nothing to look for, it does nothing and closes its
    connection.
    """

    _process: "Watcher | None" = None

    @classmethod
    def of_this_process(cls) -> "Watcher":
        watcher = cls._process
        if watcher is None or watcher.pid != os.getpid() or not watcher.is_alive():
            watcher = cls._process = cls()
            watcher.start()
        return watcher

    def __init__(self):
        super().__init__(name="fairshare-watcher", daemon=True)
        self.pid = os.getpid()
        # Held while a tick acts for the watched run, and to change which run that is: once
        # `watching` returns, nothing more is done for its run (no renewal, growth or SIGXCPU).
        self._lock = threading.Lock()
        self._run: _Watched | None = None
        self._wake = threading.Event()
        self._refill_wanted = threading.Event()
        self._refilled = threading.Event()
        self._looks: set[tuple[int, str]] = set()  # (account, queue) settled since the last tick
        self._looks_lock = threading.Lock()

    @contextlib.contextmanager
    def watching(self, slot_id: int, budget: RunBudget, *, interrupt_main: bool) -> Iterator[None]:
        # The first renewal comes well before a claim's lease could end: a job admitted ahead starts
        # on it (budgets.ledger `start_admitted` leaves the slot's lease as the claim set it).
        first_renewal_s = min(settings.FAIRSHARE["RESERVATION_HEARTBEAT_S"], standing.claim_lease_s() / 4)
        renew_at = time.monotonic() + first_renewal_s
        with self._lock:
            self._run = _Watched(slot_id, budget, interrupt_main, next_renew=renew_at)
        budget.refill = self.refill
        try:
            yield
        finally:
            budget.finished = True
            with self._lock:
                self._run = None

    def refill(self) -> None:
        """From the run's thread: its allowance is spent; reserve more now if there is any."""
        self._refilled.clear()
        self._refill_wanted.set()
        self._wake.set()
        self._refilled.wait(REFILL_WAIT_S)

    def look_again_later(self, *, account_id: int, queue: str) -> None:
        """From the run's thread, after its settlement committed: look at the next tick whether
        anything of the account's is held on the queue, and release what may go."""
        with self._looks_lock:
            self._looks.add((account_id, queue))

    def run(self) -> None:
        options = settings.FAIRSHARE
        tick, step = options["BUDGET_TICK_S"], options["RESERVATION_STEP_MS"]
        while True:
            self._wake.wait(tick)
            self._wake.clear()
            with self._lock:
                try:
                    if self._run is not None:
                        self._tick(self._run, step=step, renew_every=options["RESERVATION_HEARTBEAT_S"])
                except Exception:  # a missed renewal only shortens the lease; the next one may work
                    connections.close_all()
                finally:
                    if self._refill_wanted.is_set():
                        self._refill_wanted.clear()
                        self._refilled.set()
            looked = self.look()
            if self._run is None and not looked:
                connections.close_all()  # this thread's own, if a run or a look needed one

    def look(self) -> bool:
        """The looks asked for since the last tick (outside the lock: a run may start meanwhile).
        One that fails is left to the worker's pulse, which releases due held work every second."""
        with self._looks_lock:  # a look asked for from now on waits for the next tick
            looks, self._looks = self._looks, set()
        for account_id, queue in looks:
            try:
                release_if_ready(account_id=account_id, queue=queue)
            except Exception:
                connections.close_all()
        return bool(looks)

    def _tick(self, run: _Watched, *, step: int, renew_every: float) -> None:
        budget, now = run.budget, time.monotonic()
        wanted, remaining = self._refill_wanted.is_set(), budget.remaining()
        # Asked, or running low (not again within a second of a refusal while some is left).
        low = remaining < step // 2 and (now >= run.next_grow or remaining <= 0)
        if budget.slot_lost:
            return
        if not budget.exhausted and (wanted or low):
            granted = reservation_grow(slot_id=run.slot_id, cpu_ms=budget.used_ms(), want_ms=step)
            run.next_renew = now + renew_every  # growing renewed the lease too
            if granted is None:
                self._slot_gone(run)
            elif granted:
                budget.grow(granted)
            elif budget.remaining() <= 0:
                budget.exhausted = True  # everything left today is reserved or used
            else:
                run.next_grow = now + 1  # others hold the rest; ask again in a second
        elif now >= run.next_renew:
            if not reservation_renew(slot_id=run.slot_id, cpu_ms=budget.used_ms()):
                self._slot_gone(run)
            run.next_renew = now + renew_every
        if (budget.slot_lost or (budget.exhausted and budget.remaining() <= 0)) and run.interrupt_main \
                and not budget.finished:
            run.interrupt_main = False  # once: the handler raises BudgetExhausted (or SlotLost) in the run
            _thread.interrupt_main(signal.SIGXCPU)

    @staticmethod
    def _slot_gone(run: _Watched) -> None:
        """The run's slot is no longer its own: its worker was frozen past the lease (a VM pause, a
        long stop) and the slot was reclaimed, maybe given to the account's next job. It takes a
        free one again if its account has one, else it stops here (SlotLost, at this tick), so the
        account never runs more jobs than its cap allows once its worker is back."""
        allowance_ms = retake_slot(slot_id=run.slot_id)
        if allowance_ms is None:
            run.budget.slot_lost = True
        else:
            run.budget.reset(allowance_ms)
