"""The budget gate: budgets' enqueue-time check, plugged into the kernel through
FAIRSHARE["ENQUEUE_GATES"] (see scheduling.runtime.EnqueueGate)."""
from budgets import services
from scheduling.envelope import Envelope


class BudgetGate:
    """Account work goes to the broker only into a free slot of an account with budget left today
    and nothing held before it; otherwise it waits in the holding area."""

    def admit(self, *, envelope: Envelope, queue: str) -> bool:
        return services.admit_at_enqueue(envelope=envelope, queue=queue)

    def undo(self, *, envelope: Envelope, queue: str) -> None:
        services.undispatch(envelope=envelope, queue=queue)

    def release_due(self) -> int:
        return services.release_due()
