"""What one run carries through the task middleware chain (`TaskContext`), and the held job a
worker goes on with after it (`Handoff`).

The kernel owns these fields; a middleware that needs state of its own for the run (budgets: its
slot, its allowance, the job it handed the slot on to) keeps it in `admission`, a value of its own
type that the kernel passes along and never looks into.
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import TaskRun
from scheduling.registry import Job


class UnlimitedBudget:
    """A run's CPU allowance when no middleware sets one: checking it never stops the run."""

    def remaining(self) -> float:
        return math.inf

    def check(self) -> None:
        pass


def _no_next_run() -> bool:
    return False


@dataclass
class TaskContext:
    """What middleware and handlers share about one run."""

    message: Any
    envelope: Envelope | None = None
    job: Job | None = None
    # The run's record (scheduling.services: inserted when it starts, finished when it ends; a
    # middleware that records its end in its own write sets its outcome, and nothing more is written).
    run: TaskRun | None = None
    meter: Meter = field(default_factory=Meter)
    # Set by the handler: how many items it processed, and "skipped" when it had nothing to do.
    items: int = 0
    outcome: str | None = None
    # A failure a middleware handled (e.g. classified for retry) that the run record must show.
    error: BaseException | None = None
    # The run's CPU allowance; long jobs call `budget.check()` between batches. A middleware may
    # set a limited one (budgets.limits.RunBudget raises budgets.limits.BudgetExhausted).
    budget: Any = field(default_factory=UnlimitedBudget)
    # The worker whose claim on a held job this run is (work conservation, `scheduling.runtime.execute`):
    # None for a job that came through the broker.
    claimed_by: str | None = None
    # What the admitting middleware made of this run, its own value (budgets: `budgets.slots.RunSlot`);
    # for a claimed job, what that middleware did for it ahead (`Handoff.admission`).
    admission: Any = None
    # Whether the worker will run another claimed job after this one (its loop has room): a
    # middleware that frees a slot hands it on only then.
    may_run_next: Callable[[], bool] = _no_next_run
    # What an app's middleware and its job's handler share about the run, under the app's name (the
    # tasks app: its call's claim and completion, sent in the round trips of the admission and
    # settlement); the kernel never looks into it.
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Handoff:
    """A held job claimed for this worker to run next, and what was done for it ahead: its run's
    record, inserted (`run`), and the admitting middleware's `admission`, when the middleware that
    handed it off admitted it already (budgets' settlement does, in its own statement)."""

    envelope: Envelope
    run: TaskRun | None = None
    admission: Any = None
