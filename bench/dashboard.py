"""How long each panel of the operations dashboard (/admin/dashboard/ and its panels, each range
of the throughput panel) and the fair-share view (/admin/fairshare/, its table with and without a
search) take, and how many queries each reads, as the accounts, the history and the holding area
grow: every page reads bounded windows (the last hour or day of task runs, 14 days of the ledger
and the daily roll-ups, the Backlog counts, the top-N budgets), so neither the query count nor
the time should follow the history or the held jobs.

    .venv/bin/python bench/dashboard.py              # 10,000 accounts; 1 vs 365 days; 0, 10,000, 100,000 held
    .venv/bin/python bench/dashboard.py --quick      # 10 accounts; 1 vs 30 days; 0 and 10,000 held
    .venv/bin/python bench/dashboard.py --accounts 1000 --days 1,90 --held 0,100000

Uses its own database (fairshare_bench_dashboard); prints a table and writes
bench/results/dashboard[-quick].json.
"""
import argparse
import contextlib
import datetime as dt
import time
from pathlib import Path

import harness as h


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--accounts", type=int)
    parser.add_argument("--recent-runs", type=int, help="task runs of the last 14 days (not rolled up yet)")
    parser.add_argument("--days", help="days of history, comma-separated (default 1,365; --quick 1,30)")
    parser.add_argument("--held", help="held jobs, comma-separated (default 0,10000,100000; --quick 0,10000)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--db-name", default="fairshare_bench_dashboard")
    parser.add_argument("--drop", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    args.accounts = args.accounts or (10 if args.quick else 10_000)
    args.recent_runs = args.recent_runs or (20_000 if args.quick else 200_000)
    args.days = [int(d) for d in (args.days or ("1,30" if args.quick else "1,365")).split(",")]
    args.held = [int(n) for n in (args.held or ("0,10000" if args.quick else "0,10000,100000")).split(",")]
    return args


PAGES = {
    "dashboard page": "/admin/dashboard/",
    "panel queues": "/admin/dashboard/panels/queues/",
    "panel throughput recent": "/admin/dashboard/panels/throughput/?range=recent",
    "panel throughput 1h": "/admin/dashboard/panels/throughput/?range=1h",
    "panel throughput 24h": "/admin/dashboard/panels/throughput/?range=24h",
    "panel throughput 14d": "/admin/dashboard/panels/throughput/?range=14d",
    "panel held": "/admin/dashboard/panels/held/",
    "panel usage": "/admin/dashboard/panels/usage/",
    "fair share page": "/admin/fairshare/",
    "fair share json": "/admin/fairshare/table/?format=json",
    "fair share search": "/admin/fairshare/table/?q=tenant-99",
}


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


def hold(*, held: int) -> None:
    """`held` jobs in the holding area, spread over the accounts (every tenth account's line), a
    tenth of them waiting for the next budget day; the triggers count them in Backlog."""
    from django.db import connection
    from django.utils import timezone

    from budgets.models import Account
    from scheduling.models import DeferredTask

    h.reset_tables("scheduling.DeferredTask")
    if not held:
        return
    ids = list(Account.objects.order_by("pk").values_list("pk", flat=True)[::10]) or list(
        Account.objects.values_list("pk", flat=True))
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {DeferredTask._meta.db_table} (account_id, queue, job, ref, reason, eligible_at, created_at, "
            "in_line_since, deferrals, priority, claimed_by, envelope_version) "
            "SELECT (%(ids)s::bigint[])[1 + i %% %(n)s], 'default', 'tests.noop', 'held-' || i, "
            "CASE WHEN i %% 10 = 0 THEN 'budget_exhausted' ELSE 'concurrency_cap' END, %(now)s, "
            "%(now)s - (i || ' seconds')::interval, %(now)s, 1, 0, '', 1 FROM generate_series(1, %(held)s) AS i",
            {"ids": ids, "n": len(ids), "now": now, "held": held})
        cursor.execute("ANALYZE")


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
    pages = {}
    for name, url in PAGES.items():
        client.get(url)  # warm-up: templates compiled, connection open
        times, queries = [], []
        for _ in range(repeat):
            with CaptureQueriesContext(connection) as captured:
                start = time.perf_counter()
                response = client.get(url)
                times.append((time.perf_counter() - start) * 1000)
            assert response.status_code == 200, (url, response.status_code)
            queries.append(len(captured.captured_queries))
        pages[name] = {"median_ms": h.median(times), "max_ms": max(times), "queries": max(queries)}
    return pages


def main(argv=None) -> int:
    args = parse_args(argv)
    db_url = h.prepare(args.db_name, fresh=False, drop=args.drop, test_jobs=False)
    info = h.machine_info(db_url)
    rows, results = [], []
    for days in args.days:
        h.log(f"filling {args.accounts} accounts x {days} day(s) of history, {args.recent_runs} recent runs")
        sizes = fill(accounts=args.accounts, days=days, recent_runs=args.recent_runs)
        for held in args.held:
            h.log(f"holding {held} jobs")
            hold(held=held)
            pages = measure(args.repeat)
            results.append({"days": days, "held": held, **sizes, "pages": pages})
            for name, figures in pages.items():
                rows.append([str(days), f"{held:,}", name, str(figures["queries"]), h.fmt(figures["median_ms"], ".1f"),
                             h.fmt(figures["max_ms"], ".1f")])
    print(f"{args.accounts:,} accounts, {args.recent_runs:,} task runs in the last 14 days")
    print(h.render_table(["history days", "held jobs", "page", "queries", "median ms", "max ms"], rows,
                         right=[0, 1, 3, 4, 5]))
    h.write_results(Path(args.json) if args.json else h.RESULTS_DIR / ("dashboard-quick.json" if args.quick else "dashboard.json"), {
        "benchmark": "dashboard", "timestamp": h.utc_timestamp(), "machine": info,
        "parameters": {"accounts": args.accounts, "recent_runs": args.recent_runs, "repeat": args.repeat,
                       "days": args.days, "held": args.held},
        "results": results,
    })
    return 0


if __name__ == "__main__":
    h.run(lambda: main())
