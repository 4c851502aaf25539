"""The baselines of bench/budget_overhead.py: django-q2 task functions outside Fairshare's chain.

Not Fairshare jobs (that is `scheduling.noop`, which the benchmark's chain path runs): a job's
handler takes the chain's TaskContext, and the chain is what these baselines leave out.
Workers import them as `bench.noop.…` (manage.py's folder, the repository, is on their path).
"""


def noop(*args, **kwargs) -> None:
    pass


def recorded(message: dict) -> None:
    """Nothing but the run's record: a TaskRun inserted as the run starts and completed as it
    ends (`task_run_mark_started`, `task_run_end`; no budget, no metering: its figures are zeros),
    what any chain that keeps a TaskRun per run writes at the least. Its throughput bounds what the
    chain can reach."""
    from scheduling.metering import Meter
    from scheduling.models import Outcome
    from scheduling.services import RunEnd, task_run_end, task_run_mark_started, task_run_new

    run = task_run_new(job=message["job"], queue="default", account_id=message["account"], ref=message["ref"])
    task_run_mark_started(run=run)
    task_run_end(run_id=run.pk, end=RunEnd(meter=Meter(), outcome=Outcome.SUCCEEDED))
