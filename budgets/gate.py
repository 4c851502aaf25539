"""The budget gate: budgets' enqueue-time check and the held work a free worker runs next,
plugged into the kernel through FAIRSHARE["ENQUEUE_GATES"] (scheduling.gates.EnqueueGate)."""
from budgets import admission, bulk, handoff, reclaim, waits
from budgets.middleware import RunSlot
from scheduling.context import Handoff, TaskContext
from scheduling.envelope import Envelope
from scheduling.gates import EnqueueGate, Wait


class BudgetGate(EnqueueGate):
    """Account work goes to the broker only when its account may run it now; else it is held."""

    def admit(self, *, envelope: Envelope, queue: str) -> bool:
        return admission.admit_at_enqueue(envelope=envelope, queue=queue)

    def undo(self, *, envelope: Envelope, queue: str) -> None:
        admission.undispatch(envelope=envelope, queue=queue)

    def admit_many(self, *, envelopes: list[Envelope], queue: str) -> list[bool]:
        return bulk.admit_many_at_enqueue(envelopes=envelopes, queue=queue)

    def release_due(self, *, idle_workers: dict[str, int] | None = None) -> int:
        return handoff.release_due(idle_workers=idle_workers)

    def next_for(self, *, queue: str, worker: str, after: TaskContext) -> Handoff | None:
        """The job the run's settlement handed its slot on to, else one pulled in fair order (unless
        the settlement saw no held work that could go, or the worker's loop has no room)."""
        settled = after.admission.settled if isinstance(after.admission, RunSlot) else None
        claimed = settled.handed_to if settled is not None else None
        if claimed is None and (settled is None or settled.waiting) and after.may_run_next():
            claimed = handoff.fetch_next(queue=queue, worker=worker)
        if claimed is None:
            return None
        return Handoff(claimed.envelope, run=claimed.run, admission=claimed)

    def worker_died(self, *, worker: str) -> int:
        return reclaim.reclaim_worker(worker=worker)

    def explain_lines(self, *, lines: set[tuple[int, str]]) -> dict[tuple[int, str], Wait]:
        return waits.line_waits(lines=lines)

