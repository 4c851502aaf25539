"""Budget admission and settlement around every account-scoped task (SPEC §4 Budgets)."""
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

from budgets import handoff, services
from budgets.limits import BudgetExhausted, RunBudget, cpu_limit
from scheduling.models import Outcome
from scheduling.faults import fault_point
from scheduling.runtime import retry_on_disconnect
from scheduling.services import final_outcome, worker_id

# How long a run that spent its allowance waits for the watcher thread to reserve more.
REFILL_WAIT_S = 10


@dataclass
class _Watched:
    """The run a watcher looks after, and what it has done for it."""

    reservation_id: int
    budget: RunBudget
    interrupt_main: bool
    next_renew: float
    next_grow: float = 0.0


class Watcher(threading.Thread):
    """The worker process's companion thread, on its own database connection, watching the run in
    progress (django-q2 runs one task at a time in a worker process; the thread is started by the
    process's first run and lives as long as the process, so a run pays no thread start).

    Every tick it looks at the run's CPU: when the allowance runs low it reserves the next step
    from the account's remaining budget (`services.reservation_grow`); when there is none left and
    the allowance is spent, it stops the run with SIGXCPU (if the run is in the main thread, where
    `cpu_limit` handles it). Every RESERVATION_HEARTBEAT_S it reports the CPU used so far and
    renews the reservation's lease, so the slot of a run whose worker died is reclaimed once the
    lease expires. It also makes the look after the settlements since its last tick, once per
    account and queue (`look_later`, `services.release_if_held`): each run's settlement spares
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
    def watching(self, reservation_id: int, budget: RunBudget, *, interrupt_main: bool) -> Iterator[None]:
        renew_at = time.monotonic() + settings.FAIRSHARE["RESERVATION_HEARTBEAT_S"]
        with self._lock:
            self._run = _Watched(reservation_id, budget, interrupt_main, next_renew=renew_at)
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

    def look_later(self, *, account_id: int, queue: str) -> None:
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
                services.release_if_held(account_id=account_id, queue=queue)
            except Exception:
                connections.close_all()
        return bool(looks)

    def _tick(self, run: _Watched, *, step: int, renew_every: float) -> None:
        budget, now = run.budget, time.monotonic()
        wanted, remaining = self._refill_wanted.is_set(), budget.remaining()
        # Asked, or running low (not again within a second of a refusal while some is left).
        low = remaining < step // 2 and (now >= run.next_grow or remaining <= 0)
        if not budget.exhausted and (wanted or low):
            granted = services.reservation_grow(
                reservation_id=run.reservation_id, cpu_ms=budget.used_ms(), want_ms=step)
            run.next_renew = now + renew_every  # growing renewed the lease too
            if granted:
                budget.grow(granted)
            elif budget.remaining() <= 0:
                budget.exhausted = True  # everything left today is reserved or used
            else:
                run.next_grow = now + 1  # others hold the rest; ask again in a second
        elif now >= run.next_renew:
            services.reservation_renew(reservation_id=run.reservation_id, cpu_ms=budget.used_ms())
            run.next_renew = now + renew_every
        if budget.exhausted and budget.remaining() <= 0 and run.interrupt_main and not budget.finished:
            run.interrupt_main = False  # once: the handler raises BudgetExhausted in the run
            _thread.interrupt_main(signal.SIGXCPU)


class BudgetMiddleware:
    """Admit (reserve CPU + take a slot, or hold the job), meter, settle exactly once."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        if not ctx.job.account_scoped:
            return self.call_next(ctx)  # its allowance stays the kernel's unlimited one
        queue = ctx.job.queue
        if isinstance(ctx.admission, handoff.Admitted):  # admitted ahead, with its claim
            admission = services.start_admitted(admitted=ctx.admission, envelope=ctx.envelope, queue=queue,
                                                worker=ctx.claim)
        else:
            admission = services.admit(
                envelope=ctx.envelope, queue=queue, estimate_ms=ctx.job.cpu_estimate_ms,
                run=ctx.run, worker=worker_id(), claim=ctx.claim,
            )
        if not admission.admitted:
            # No reason: a claimed job whose claim expired meanwhile; it was released elsewhere.
            ctx.outcome = Outcome.DEFERRED if admission.reason else Outcome.SKIPPED
            return
        ctx.paused = admission.paused  # read with the account's state: spares the pause check a query
        ctx.budget = budget = RunBudget(admission.allowance_ms)
        in_main_thread = threading.current_thread() is threading.main_thread()
        watcher = Watcher.of_this_process()
        cap_hit = escaped = False
        try:
            with cpu_limit(budget):
                with watcher.watching(admission.reservation_id, budget, interrupt_main=in_main_thread):
                    self.call_next(ctx)
        except BudgetExhausted:
            cap_hit = True
            ctx.outcome = Outcome.BUDGET_EXHAUSTED
        except BaseException:
            escaped = True  # the run recording (outside) decides how it ended
            raise
        finally:
            ctx.meter.stop()
            # Settlement is one transaction that deletes the reservation: a try that committed
            # before its connection went leaves the next nothing to charge. A run that still
            # cannot settle is charged what its TaskRun recorded when it is reclaimed.
            # The freed slot goes to the account's next held job: run by this worker straight
            # after this run when it will (scheduling.runtime.execute), else sent to the broker.
            # Unless a failure got past the chain inside, the run's record is completed with it.
            handoff_to = worker_id() if ctx.accepts_handoff() else None
            outcome = None if escaped else final_outcome(ctx.outcome, ctx.error)
            settled = retry_on_disconnect(lambda: services.settle(
                reservation_id=admission.reservation_id, account_id=ctx.envelope.account, queue=queue,
                meter=ctx.meter, cap_hit=cap_hit, envelope=ctx.envelope, handoff_to=handoff_to,
                outcome=outcome, items=ctx.items, error=ctx.error, expect_held=ctx.claim is not None,
                look_later=watcher.look_later,
            ))
            ctx.recorded = outcome is not None and settled is not None
            ctx.handoff = settled.handoff if settled else None
            ctx.may_pull = settled.waiting if settled else True
            fault_point("after_settle")
