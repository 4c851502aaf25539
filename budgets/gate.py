"""The budget gate: budgets' enqueue-time check, plugged into the kernel through
FAIRSHARE["ENQUEUE_GATES"] (see scheduling.runtime.EnqueueGate)."""
from budgets import bulk, handoff, services
from scheduling.envelope import Envelope


class BudgetGate:
    """Account work goes to the broker only into a free slot of an account with budget left today
    and nothing held before it; otherwise it waits in the holding area."""

    def admit(self, *, envelope: Envelope, queue: str) -> bool:
        return services.admit_at_enqueue(envelope=envelope, queue=queue)

    def undo(self, *, envelope: Envelope, queue: str) -> None:
        services.undispatch(envelope=envelope, queue=queue)

    def admit_many(self, *, envelopes: list[Envelope], queue: str) -> list[bool]:
        return bulk.admit_many_at_enqueue(envelopes=envelopes, queue=queue)

    def release_due(self) -> int:
        return services.release_due()

    def next_for(self, *, queue: str, worker: str) -> Envelope | None:
        return handoff.pull(queue=queue, worker=worker)
