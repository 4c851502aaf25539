"""How long the operations dashboard (/admin/dashboard/) takes with one day and with a year of
history, and how many queries it reads: the dashboard reads bounded windows (24 h of task runs,
14 days of the ledger and of the daily roll-ups), so neither should grow with the history.

    .venv/bin/python bench/dashboard.py              # 50 accounts, 1 vs 365 days, 200,000 recent runs
    .venv/bin/python bench/dashboard.py --quick      # 10 accounts, 20,000 recent runs

Uses its own database (fairshare_bench_dashboard); prints a table and writes
bench/results/dashboard[-quick].json.
"""
import argparse
import contextlib
import datetime as dt
import time

import harness as h


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--accounts", type=int)
    parser.add_argument("--recent-runs", type=int, help="task runs of the last 14 days (not rolled up yet)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--db-name", default="fairshare_bench_dashboard")
    parser.add_argument("--drop", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.accounts = args.accounts or (10 if args.quick else 50)
    args.recent_runs = args.recent_runs or (20_000 if args.quick else 200_000)
    return args


def fill(*, accounts: int, days: int, recent_runs: int) -> dict[str, int]:
    """Accounts with budgets, `days` days of daily roll-ups and ledger rows, recent task runs."""
    from django.utils import timezone

    from budgets.models import Account, UsageDay
    from budgets.plans import budgets_ensure_defaults
    from scheduling.models import Outcome, TaskRun, TaskRunDaily

    h.reset_tables("budgets.Account", "scheduling.TaskRun", "scheduling.TaskRunDaily", "budgets.UsageDay")
    now = timezone.now()
    today = now.date()
    made = [Account.objects.create(slug=f"tenant-{i}", name=f"Tenant {i}") for i in range(accounts)]
    for account in made:
        budgets_ensure_defaults(account=account)
    for account in made:
        TaskRunDaily.objects.bulk_create([
            TaskRunDaily(day=today - dt.timedelta(days=d), account=account, job=job, queue=queue, outcome=outcome,
                         runs=40, cpu_ms=20_000)
            for d in range(1, days + 1) for job, queue in (("exports.build", "exports"), ("tests.noop", "default"))
            for outcome in (Outcome.SUCCEEDED, Outcome.FAILED)], batch_size=5000)
        UsageDay.objects.bulk_create([UsageDay(account=account, queue=q, day=today - dt.timedelta(days=d),
                                               cpu_used_ms=60_000) for d in range(days) for q in ("default", "exports")],
                                     batch_size=5000)
    span_s = 14 * 86400
    TaskRun.objects.bulk_create([
        TaskRun(account=made[i % accounts], job="tests.noop", started_at=now - dt.timedelta(seconds=span_s * i / recent_runs),
                outcome=Outcome.FAILED if i % 17 == 0 else Outcome.SUCCEEDED, cpu_ms=5, wall_ms=9)
        for i in range(recent_runs)], batch_size=10_000)
    from django.db import connection
    with connection.cursor() as cur:
        cur.execute("ANALYZE")
    return {"task_run_daily": TaskRunDaily.objects.count(), "usage_days": UsageDay.objects.count(),
            "task_runs": TaskRun.objects.count()}


def measure(repeat: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    with contextlib.suppress(RuntimeError):  # already set up by the first measurement
        setup_test_environment()  # the test client's ALLOWED_HOSTS ("testserver")
    user, _ = get_user_model().objects.get_or_create(username="bench-root", defaults={"is_staff": True, "is_superuser": True})
    client = Client()
    client.force_login(user)
    client.get("/admin/dashboard/")  # warm-up: templates compiled, connection open
    times, queries = [], []
    for _ in range(repeat):
        with CaptureQueriesContext(connection) as captured:
            start = time.perf_counter()
            response = client.get("/admin/dashboard/")
            times.append((time.perf_counter() - start) * 1000)
        assert response.status_code == 200
        queries.append(len(captured.captured_queries))
    return {"median_ms": h.median(times), "max_ms": max(times), "queries": max(queries)}


def main(argv=None) -> int:
    args = parse_args(argv)
    db_url = h.prepare(args.db_name, fresh=False, drop=args.drop, test_jobs=False)
    info = h.machine_info(db_url)
    rows, results = [], []
    for days in (1, 365):
        h.log(f"filling {args.accounts} accounts x {days} day(s) of history, {args.recent_runs} recent runs")
        sizes = fill(accounts=args.accounts, days=days, recent_runs=args.recent_runs)
        result = {"days": days, **sizes, **measure(args.repeat)}
        results.append(result)
        rows.append([str(days), f"{sizes['task_run_daily']:,}", f"{sizes['usage_days']:,}", f"{sizes['task_runs']:,}",
                     str(result["queries"]), h.fmt(result["median_ms"], ".1f"), h.fmt(result["max_ms"], ".1f")])
    print(h.render_table(["history days", "daily roll-ups", "ledger rows", "task runs", "queries", "median ms",
                          "max ms"], rows, right=range(1, 7)))
    h.write_results(args.json or h.RESULTS_DIR / ("dashboard-quick.json" if args.quick else "dashboard.json"), {
        "benchmark": "dashboard", "timestamp": h.utc_timestamp(), "machine": info,
        "parameters": {"accounts": args.accounts, "recent_runs": args.recent_runs, "repeat": args.repeat},
        "results": results,
    })
    return 0


if __name__ == "__main__":
    h.run(lambda: main())
