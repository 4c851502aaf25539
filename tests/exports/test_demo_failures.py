"""The demo workload's failures (exports/demo.py `fail_on_purpose`), run by real workers with the
demo's job module and export storage: a job that fails once and is retried, one that fails for
good, and an export retried after a storage error, each classified by the retry middleware as any
job's failure is."""
import pytest
from django.utils import timezone

from exports import demo
from exports.models import AttemptOutcome, ExportRecord, ExportStatus
from scheduling import processes
from scheduling.models import DeferredTask, Outcome, TaskRun
from tests.budgets.test_processes import wait
from tests.exports.conftest import FAST_RECOVERY
from tests.exports.support import attempts, wait_finished, wait_runs_settled

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

DEMO = {"FAIRSHARE_EXTRA_JOB_MODULES": "tests.jobs,exports.demo",
        "FAIRSHARE_EXPORTS_STORAGE_BACKEND": "exports.demo.HiccupStorage"}


def outcomes(job: str) -> list[str]:
    return list(TaskRun.objects.filter(job=job).order_by("started_at", "id").values_list("outcome", flat=True))


def test_the_workloads_failures_end_as_an_operator_is_told(owner, start_cluster, start_exports):
    since = timezone.now()
    clusters = [start_cluster("default", **FAST_RECOVERY, **DEMO), start_exports(**DEMO)]
    processes.wait_ready(clusters, {"default": 1, "exports": 1}, since=since)
    accounts = demo.ensure_accounts()

    did = [line for second in (demo.FLAKY_AT_S, demo.BROKEN_AT_S, demo.HICCUP_AT_S)
           for line in demo.fail_on_purpose(accounts, second)]
    assert len(did) == 3
    [export] = ExportRecord.objects.filter(account=accounts[demo.EXPORTER])

    wait(lambda: outcomes(demo.FLAKY_JOB) == [Outcome.RETRYING, Outcome.SUCCEEDED]
         and outcomes(demo.BROKEN_JOB) == [Outcome.FAILED], timeout=60, what="the jobs' runs", clusters=clusters)
    [broken_run, flaky_run] = TaskRun.objects.filter(job__in=[demo.FLAKY_JOB, demo.BROKEN_JOB], error_class__gt="") \
        .order_by("job")
    assert (broken_run.job, broken_run.error_class) == (demo.BROKEN_JOB, "ValueError")
    assert (flaky_run.job, flaky_run.error_class) == (demo.FLAKY_JOB, "ConnectionResetError")

    wait_finished(export, clusters[1], timeout=60)
    assert export.status == ExportStatus.SUCCEEDED
    assert wait_runs_settled(export, clusters[1]) == [Outcome.RETRYING, Outcome.SUCCEEDED]
    assert attempts(export) == [AttemptOutcome.FAILED, AttemptOutcome.SUCCEEDED]
    assert export.attempts.get(number=1).error_class == "ConnectionResetError"
    assert not DeferredTask.objects.exists()  # nothing left waiting
