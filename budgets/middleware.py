"""Budget admission and settlement around every account-scoped task (SPEC §4 Budgets)."""
import threading

from django.conf import settings
from django.db import connections

from budgets import services
from budgets.limits import BudgetExhausted, RunBudget, UnlimitedBudget, cpu_limit
from scheduling.models import Outcome
from scheduling.services import worker_id


class Heartbeat(threading.Thread):
    """Reports the run's CPU and renews its reservation's lease while the run is alive."""

    def __init__(self, reservation_id: int, budget: RunBudget):
        super().__init__(name=f"fairshare-heartbeat-{reservation_id}", daemon=True)
        self.reservation_id = reservation_id
        self.budget = budget
        self._stopping = threading.Event()

    def run(self) -> None:
        interval = settings.FAIRSHARE["RESERVATION_HEARTBEAT_S"]
        try:
            while not self._stopping.wait(interval):
                try:
                    services.reservation_heartbeat(reservation_id=self.reservation_id, cpu_ms=self.budget.used_ms())
                except Exception:  # a missed beat only shortens the lease; the next one may work
                    connections.close_all()
        finally:
            connections.close_all()  # this thread's own connections

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self._stopping.set()
        self.join()


class BudgetMiddleware:
    """Admit (reserve CPU + take a slot, or hold the job), meter, settle exactly once."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        if not ctx.job.account_scoped:
            ctx.budget = UnlimitedBudget()
            return self.call_next(ctx)
        queue = ctx.job.queue
        admission = services.admit(
            envelope=ctx.envelope, queue=queue, estimate_ms=ctx.job.cpu_estimate_ms,
            task_run_id=ctx.run.pk if ctx.run else None, worker=worker_id(),
        )
        if not admission.admitted:
            ctx.outcome = Outcome.DEFERRED
            return
        ctx.budget = RunBudget(admission.allowance_ms)
        cap_hit = False
        try:
            with Heartbeat(admission.reservation_id, ctx.budget):
                with cpu_limit(admission.allowance_ms):
                    self.call_next(ctx)
        except BudgetExhausted:
            cap_hit = True
            ctx.outcome = Outcome.BUDGET_EXHAUSTED
        finally:
            ctx.meter.stop()
            services.settle(
                reservation_id=admission.reservation_id, account_id=ctx.envelope.account, queue=queue,
                meter=ctx.meter, cap_hit=cap_hit, hold_envelope=ctx.envelope if cap_hit else None,
            )
