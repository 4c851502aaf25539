"""The capacity rehearsal at small scale: real qclusters per round, a report with every figure,
and a recommendation among the tried concurrencies."""
import io
import json
import time

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from budgets import clock
from budgets.models import Account, Budget, UsageDay
from exports.models import ActivityEvent, ExportRecord, ExportStatus
from exports.rehearsal import RoundResult, recommend
from scheduling.models import TaskRun
from scheduling.runtime import execute

pytestmark = pytest.mark.django_db

ROUND_FIELDS = {
    "concurrency", "exports_requested", "exports_succeeded", "small_jobs_requested", "small_jobs_done",
    "rows_exported", "makespan_s", "exports_per_minute", "oldest_job_age_s", "oldest_export_age_s",
    "p95_latency_s", "p95_export_latency_s", "p95_small_job_latency_s", "errors", "unfinished", "retries",
    "deferrals", "cpu_share", "db_wait_share", "storage_wait_share", "other_share", "peak_rss_mib", "load_before",
    "load_after", "peak_db_connections", "timed_out", "logs",
}


@pytest.mark.django_db(transaction=True)
@pytest.mark.processes
def test_rehearse_replays_the_backlog_per_concurrency_and_recommends_one_of_them(tmp_path, export_root):
    out = io.StringIO()
    path = tmp_path / "results" / "rehearsal.json"

    call_command("rehearse", "--concurrency", "1,2", "--exports", "3", "--small-jobs", "10", "--rows", "2000",
                 "--timeout", "45", "--json", str(path), stdout=out)

    report = json.loads(path.read_text())
    assert report["plan"]["concurrencies"] == [1, 2]
    assert [r["concurrency"] for r in report["rounds"]] == [1, 2]
    for r in report["rounds"]:
        assert set(r) == ROUND_FIELDS
        assert not r["timed_out"], r
        assert (r["exports_requested"], r["exports_succeeded"], r["errors"]) == (3, 3, 0), r
        assert (r["small_jobs_requested"], r["small_jobs_done"]) == (10, 10)
        assert r["exports_per_minute"] > 0 and r["makespan_s"] > 0
        assert 0 <= r["oldest_job_age_s"] and 0 < r["p95_latency_s"]
        assert 0 <= r["oldest_export_age_s"] <= r["oldest_job_age_s"]
        assert r["p95_export_latency_s"] > 0 and r["p95_small_job_latency_s"] > 0
        for share in ("cpu_share", "db_wait_share", "storage_wait_share", "other_share"):
            assert 0 <= r[share] <= 1.5, (share, r[share])
        assert r["db_wait_share"] > 0  # every export reads its rows from PostgreSQL
        assert r["peak_rss_mib"] > 10  # a Django worker process, measured
        assert r["load_after"] >= 0 and r["peak_db_connections"] >= 1
    # Every round exported the same backlog: the same rows.
    assert report["rounds"][0]["rows_exported"] == report["rounds"][1]["rows_exported"] > 0

    rec = report["recommendation"]
    assert rec["concurrency"] in (1, 2)
    assert rec["memory_budget_mib"] >= rec["peak_rss_per_export_mib"] * rec["concurrency"] > 0
    assert rec["reason"]

    printed = out.getvalue()
    assert report["table"] in printed
    assert f"Recommendation: {rec['concurrency']} export worker(s)" in printed
    assert "exp/min" in printed and "db wait %" in printed

    # Only the last round's work is left, in the dedicated account; budgets never limited it.
    account = Account.objects.get(slug="rehearsal")
    assert ActivityEvent.objects.filter(account=account).count() == 2000
    assert ExportRecord.objects.filter(account=account, status=ExportStatus.SUCCEEDED).count() == 3
    assert TaskRun.objects.filter(account=account, job="scheduling.noop").count() >= 10
    assert all(b.max_concurrent >= 2 for b in Budget.objects.filter(account=account))
    assert "password" not in path.read_text().lower()


def _round(c: int, per_minute: float, db_share: float, errors: int = 0, rss: float = 100.0) -> RoundResult:
    return RoundResult(
        concurrency=c, exports_requested=10, exports_succeeded=10, small_jobs_requested=0, small_jobs_done=0,
        rows_exported=0, makespan_s=1, exports_per_minute=per_minute, oldest_job_age_s=0, oldest_export_age_s=0,
        p95_latency_s=0, p95_export_latency_s=0, p95_small_job_latency_s=0, errors=errors, unfinished=0, retries=0,
        deferrals=0, cpu_share=0.3, db_wait_share=db_share, storage_wait_share=0.01, other_share=0.1, peak_rss_mib=rss,
        load_before=0, load_after=0, peak_db_connections=0, timed_out=False,
    )


def test_stop_rule_stops_when_throughput_stalls_while_db_wait_grows():
    rec = recommend([_round(1, 10, 0.30), _round(2, 18, 0.35), _round(4, 19, 0.55), _round(8, 30, 0.60)])
    assert (rec.concurrency, rec.stopped, rec.stopped_between) == (2, True, [2, 4])
    assert rec.memory_budget_mib == 200


def test_stop_rule_does_not_fire_when_db_wait_does_not_grow():
    rec = recommend([_round(1, 10, 0.50), _round(2, 10.5, 0.40), _round(4, 20, 0.40)])
    assert (rec.concurrency, rec.stopped) == (4, False)
    # Within 10% of the best costs no more workers than needed.
    assert recommend([_round(1, 10, 0.5), _round(2, 10.5, 0.4)]).concurrency == 1


def test_rounds_with_errors_are_not_recommended():
    rec = recommend([_round(1, 10, 0.30), _round(2, 20, 0.30, errors=3)])
    assert rec.concurrency == 1


def test_rehearse_rejects_a_bad_concurrency_list():
    with pytest.raises(CommandError, match="comma-separated"):
        call_command("rehearse", "--concurrency", "1,two")


def test_a_runs_recorded_db_wait_is_what_the_ledger_was_charged_and_within_its_wall_time(account):
    """The rehearsal's CPU / DB-wait / storage-wait shares come from TaskRun: its figures must be
    the run's own, fixed when the meter stops (settlement's queries come after that)."""
    def slow_queries(execute, sql, params, many, context):
        time.sleep(0.005)  # every statement takes a noticeable time, settlement's too
        return execute(sql, params, many, context)

    with connection.execute_wrapper(slow_queries):
        execute({"v": 1, "job": "tests.noop", "account": account.pk, "ref": "metered"})

    run = TaskRun.objects.get(job="tests.noop", ref="metered")
    usage = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    assert run.outcome == "succeeded" and usage.runs == 1
    assert run.db_wait_ms == usage.db_wait_ms
    assert run.wall_ms == usage.wall_ms
    assert run.db_wait_ms <= run.wall_ms
