"""Reads of the scheduling app that other apps share."""
from scheduling.models import Outcome, TaskRun


def finished_run_cpu_ms(*, run_id: int) -> int | None:
    """The CPU a run recorded when it finished; None while it is still running (or if it is gone)."""
    return (TaskRun.objects.filter(pk=run_id).exclude(outcome=Outcome.RUNNING)
            .values_list("cpu_ms", flat=True).first())
