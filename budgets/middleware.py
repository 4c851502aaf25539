"""Budget admission and settlement around every account-scoped task (SPEC §4 Budgets)."""
import threading
from dataclasses import dataclass

from budgets.admission import Admission, admit, start_admitted
from budgets.ledger import Claimed
from budgets.limits import BudgetExhausted, RunBudget, SlotLost, cpu_limit
from budgets.settlement import Settled, settle
from budgets.watcher import Watcher
from scheduling.connections import retry_on_disconnect
from scheduling.faults import fault_point
from scheduling.models import Outcome
from scheduling.pausing import hold_if_paused
from scheduling.services import final_outcome, task_run_recorded, worker_id


@dataclass
class RunSlot:
    """Budgets' own value for a run (the kernel's `TaskContext.admission`): how it was admitted
    and, once settled, what became of its slot (read by budgets.gate.BudgetGate.next_for)."""

    admission: Admission
    settled: Settled | None = None


class BudgetMiddleware:
    """Admit (reserve CPU + take a slot, or hold the job), meter, settle exactly once. A job that
    a pause covers when it is admitted goes back to the holding area without running (its
    admission read that with the account's standing), so the chain needs no pause check of its own."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        if not ctx.job.account_scoped:
            return self.call_next(ctx)  # its allowance stays the kernel's unlimited one
        queue = ctx.job.queue
        if isinstance(ctx.admission, Claimed):  # admitted ahead, with its claim
            admission = start_admitted(claimed=ctx.admission, queue=queue, worker=ctx.claimed_by)
        else:
            admission = admit(envelope=ctx.envelope, queue=queue, estimate_ms=ctx.job.cpu_estimate_ms,
                              run=ctx.run, worker=worker_id())
        slot = ctx.admission = RunSlot(admission)
        if not admission.admitted:
            # No reason: a claimed job whose claim expired meanwhile; it was released elsewhere.
            ctx.outcome = Outcome.DEFERRED if admission.reason else Outcome.SKIPPED
            return
        ctx.budget = budget = RunBudget(admission.allowance_ms)
        watcher = Watcher.of_this_process()
        cap_hit = slot_lost = escaped = False
        try:
            if admission.paused and hold_if_paused(envelope=ctx.envelope, queue=queue):
                ctx.outcome = Outcome.DEFERRED  # paused since it was sent: it gives its slot back below
            else:
                in_main_thread = threading.current_thread() is threading.main_thread()
                with cpu_limit(budget), watcher.watching(admission.slot_id, budget, interrupt_main=in_main_thread):
                    self.call_next(ctx)
        except BudgetExhausted:
            cap_hit = True
            ctx.outcome = Outcome.BUDGET_EXHAUSTED
        except SlotLost:
            slot_lost = True
            ctx.outcome = Outcome.SLOT_LOST
        except BaseException:
            escaped = True  # the run recording (outside) decides how it ended
            raise
        finally:
            ctx.meter.stop()
            # One transaction that deletes the slot (a try that committed before its connection
            # went leaves the next nothing to charge; a run that still cannot settle is charged what
            # its TaskRun recorded when it is reclaimed). The freed slot goes to the account's next
            # held job, run by this worker next when it will. Unless a failure got past the chain
            # inside, the run's record is completed with it.
            outcome = None if escaped else final_outcome(ctx.outcome, ctx.error)
            slot.settled = retry_on_disconnect(lambda: settle(
                slot_id=admission.slot_id, account_id=ctx.envelope.account, queue=queue, meter=ctx.meter,
                outcome=outcome, items=ctx.items, error=ctx.error, cap_hit=cap_hit, slot_lost=slot_lost,
                envelope=ctx.envelope,
                hand_to=worker_id() if ctx.may_run_next() else None, from_line=ctx.claimed_by is not None,
                look_again_later=watcher.look_again_later))
            if slot.settled is not None:
                task_run_recorded(ctx.run, outcome=outcome)
            fault_point("after_settle")
