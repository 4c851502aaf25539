"""The baselines of bench/budget_overhead.py: django-q2 task functions outside Fairshare's chain.

Not Fairshare jobs (that is `scheduling.noop`, which the benchmark's chain path runs): a job's
handler takes the chain's TaskContext, and the chain is what these baselines leave out.
Workers import them as `bench.noop.…` (manage.py's folder, the repository, is on their path).
"""


def noop(*args, **kwargs) -> None:
    pass


def recorded(message: dict) -> None:
    """Nothing but the run's record: a TaskRun inserted as the run starts and completed as it
    ends, with the chain's own two statements for that (`task_run_insert_sql`,
    `task_run_end_sql`; no budget, no metering: its figures are zeros), what any chain that
    keeps a TaskRun per run writes at the least. Its throughput bounds what the chain can reach."""
    from django.db import connection

    from scheduling.metering import Meter
    from scheduling.models import Outcome
    from scheduling.services import RunEnd, task_run_end_sql, task_run_insert_sql, task_run_new

    run = task_run_new(job=message["job"], queue="default", account_id=message["account"], ref=message["ref"])
    with connection.cursor() as cursor:
        cursor.execute(*task_run_insert_sql(run))
        run_id = cursor.fetchone()[0]
        sql, params = task_run_end_sql(run_id_sql="%(run_id)s", end=RunEnd(meter=Meter(), outcome=Outcome.SUCCEEDED))
        cursor.execute(sql, {**params, "run_id": run_id})
