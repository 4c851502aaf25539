#!/usr/bin/env python
"""What Django's Tasks API on Fairshare costs beside Fairshare's own `@job` path, on PostgreSQL
with the ORM broker.

    .venv/bin/python bench/tasks_overhead.py            # 2,000 tasks per path, 3 rounds
    .venv/bin/python bench/tasks_overhead.py --quick    # 300 tasks per path, 2 rounds

Two paths, for one account whose budget cannot run out and whose cap does not bind (as in
bench/budget_overhead.py), in the same run, each going first in turn:

- job:  `scheduling.runtime.enqueue(job="scheduling.noop", account=, ref=)`, the kernel's one no-op
  job through the whole chain (enqueue-time check, then contract, run recording, admission,
  settlement around a handler that does nothing);
- task: `bench.tasks_noop.noop.enqueue(account=)`, a `@task` that does nothing, through the Tasks
  backend: the call stored (tasks.TaskCall) with the same enqueue-time check in the same
  transaction, then in the worker the same chain around `tasks.run.default`, which claims the call,
  calls the function and completes it.

Measured for each path:
- enqueue: N enqueues in this process with no worker running (ms per enqueue, median of rounds),
  and the SQL statements one enqueue sends;
- run in-process: N jobs enqueued with no worker running (all wait in the account's line), then
  run in this process as one idle worker runs them: the messages its pulse releases to the broker,
  and the jobs each run's settlement hands on (wall and this process's CPU per job, each checked
  to have succeeded once: the worker's side alone, less exposed to the rest of the machine than
  the cluster's throughput);
- throughput: N enqueues into a running `manage.py qcluster` (2 workers, the benchmark's own
  database), timed from the first enqueue until the broker holds none of the path's messages
  (django-q2's monitor deletes the OrmQ row when it acknowledges a finished task), as in
  budget_overhead; every call checked SUCCESSFUL, every job's run succeeded.

Goal printed: task / job >= 0.9 for enqueues per second and for tasks per second through the
cluster. Results: a table on stdout, JSON in bench/results/.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

GOAL_RATIO = 0.9
DEFAULT_DB_NAME = "fairshare_bench_tasks"
ACCOUNT_SLUG = "bench-tasks"
QUEUE = "default"
JOB = "scheduling.noop"
PATHS = ("job", "task")
SLOTS = 32767  # Budget.max_concurrent's largest value: the cap never binds here
DRAIN_TIMEOUT_S = 900
TABLES = (*h.RUN_TABLES, "tasks.TaskCall")


def setup_account() -> int:
    from budgets.models import Account, Budget, Plan

    account, _ = Account.objects.get_or_create(slug=ACCOUNT_SLUG, defaults={"name": "Benchmark", "plan": Plan.ENTERPRISE})
    Budget.objects.update_or_create(account=account, queue=QUEUE,
                                    defaults={"cpu_seconds_per_day": 10**9, "max_concurrent": SLOTS})
    return account.pk


def enqueue_all(path: str, n: int, account_id: int, tag: str) -> float:
    """Enqueue n of the path's no-ops; returns the seconds it took."""
    from bench.tasks_noop import noop
    from scheduling.runtime import enqueue

    t0 = time.perf_counter()
    if path == "job":
        for i in range(n):
            enqueue(job=JOB, account=account_id, ref=f"{tag}-{i}")
    else:
        for _ in range(n):
            noop.enqueue(account=account_id)
    return time.perf_counter() - t0


def statements_per_enqueue(path: str, account_id: int) -> list[str]:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    enqueue_all(path, 1, account_id, "warm-statements")
    with CaptureQueriesContext(connection) as queries:
        enqueue_all(path, 1, account_id, "statements")
    return [q["sql"][:140] for q in queries.captured_queries]


def measure_enqueue(n: int, rounds: int, account_id: int) -> dict:
    """N enqueues per path and round, no worker running (the messages wait in the broker)."""
    per = {path: [] for path in PATHS}
    for r in range(rounds):
        for path in PATHS[r % 2:] + PATHS[:r % 2]:
            h.reset_tables(*TABLES)
            seconds = enqueue_all(path, n, account_id, f"e{r}-{path}")
            per[path].append(seconds * 1000 / n)
    h.reset_tables(*TABLES)
    return {path: {"ms_per_enqueue": per[path], "median_ms": h.median(per[path]),
                   "statements": statements_per_enqueue(path, account_id)} for path in PATHS}


def enqueue_all_held(path: str, n: int, account_id: int, tag: str) -> None:
    """Enqueue n of the path's no-ops with no worker running: all wait in the account's line."""
    from bench.tasks_noop import noop
    from scheduling.runtime import enqueue

    for i in range(n):
        if path == "job":
            enqueue(job=JOB, account=account_id, ref=f"{tag}-{i}")
        else:
            noop.enqueue(account=account_id)


def run_in_process() -> None:
    """Run the queue's work as a worker with nothing else to do: it takes the broker's messages (the
    ORM broker's rows, acknowledged as taken) and runs each through the whole chain (django-q2
    closes old connections before each task), each run's settlement handing it the next held job;
    with no message left its pulse releases a held job to the broker (budgets.handoff.release_due
    for one idle worker); until nothing is held."""
    from django.db import close_old_connections
    from django_q.models import OrmQ
    from django_q.signing import SignedPackage

    from budgets.handoff import release_due
    from scheduling.runtime import execute

    while True:
        rows = list(OrmQ.objects.filter(key=QUEUE).order_by("id"))
        if not rows and not release_due(idle_workers={QUEUE: 1}):
            return
        for row in rows:
            row.delete()
            close_old_connections()
            execute(*SignedPackage.loads(row.payload)["args"])


def measure_execute(n: int, rounds: int, account_id: int) -> dict:
    """The worker's side alone, in this process (`run_in_process`): wall and this process's CPU per
    job, each of the n run once. Less exposed to what else the machine runs than the cluster's
    throughput."""
    from django.db.models import Count

    from scheduling.models import TaskRun

    wall = {path: [] for path in PATHS}
    cpu = {path: [] for path in PATHS}
    for r in range(rounds):
        for path in PATHS[r % 2:] + PATHS[:r % 2]:
            h.reset_tables(*TABLES)
            enqueue_all_held(path, n, account_id, f"x{r}-{path}")
            t0, c0 = time.perf_counter(), time.process_time()
            run_in_process()
            wall[path].append((time.perf_counter() - t0) * 1000 / n)
            cpu[path].append((time.process_time() - c0) * 1000 / n)
            runs = dict(TaskRun.objects.values_list("outcome").annotate(c=Count("id")).order_by())
            if runs != {"succeeded": n}:
                raise SystemExit(f"in-process {path}: {n} jobs, runs {runs}: each should have succeeded once")
    h.reset_tables(*TABLES)
    return {path: {"wall_ms": wall[path], "cpu_ms": cpu[path], "median_wall_ms": h.median(wall[path]),
                   "median_cpu_ms": h.median(cpu[path])} for path in PATHS}


def run_path(path: str, n: int, account_id: int, tag: str, cluster: h.Cluster) -> dict:
    from django.db.models import Count

    from scheduling.models import TaskRun
    from tasks.models import TaskCall

    calls_before = set(TaskCall.objects.values_list("pk", flat=True))
    cpu0 = h.machine_cpu_seconds()
    t0 = time.perf_counter()
    enqueue_s = enqueue_all(path, n, account_id, tag)
    h.wait_until(h.broker_empty, timeout=DRAIN_TIMEOUT_S, what=f"{tag}: broker drained", cluster=cluster)
    seconds = time.perf_counter() - t0
    cpu1 = h.machine_cpu_seconds()
    if path == "job":
        outcomes = dict(TaskRun.objects.filter(job=JOB, ref__startswith=f"{tag}-").values_list("outcome")
                        .annotate(c=Count("id")).order_by())
        done = outcomes.get("succeeded", 0)
    else:
        new = TaskCall.objects.exclude(pk__in=calls_before)
        outcomes = dict(new.values_list("status").annotate(c=Count("pk")).order_by())
        done = outcomes.get("SUCCESSFUL", 0)
    if done != n or len(outcomes) != 1:
        raise RuntimeError(f"{tag}: expected {n} finished, got {outcomes}:\n{cluster.tail(40)}")
    return {"tasks": n, "seconds": seconds, "tasks_per_s": n / seconds, "enqueue_s": enqueue_s,
            "enqueue_per_s": n / enqueue_s,
            "machine_cpu_ms_per_task": None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) * 1000 / n}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 300 tasks per path, 2 rounds")
    p.add_argument("--tasks", type=int, help="tasks per path and round (default 2000; 300 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds, alternating which path goes first (default 3; 2 with --quick)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--poll", type=float, default=0.1, help="FAIRSHARE_POLL of the cluster (seconds)")
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--fresh", action="store_true", help="drop and recreate the benchmark database first")
    p.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    p.add_argument("--json", type=Path, help="results file (default bench/results/tasks_overhead[-quick].json)")
    args = p.parse_args(argv)
    args.tasks = args.tasks or (300 if args.quick else 2000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.json = args.json or h.RESULTS_DIR / ("tasks_overhead-quick.json" if args.quick else "tasks_overhead.json")
    return args


def through_cluster(args, account_id: int) -> list[dict]:
    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-")
    h.at_exit(tmp.cleanup)
    env = h.cluster_env(workers=args.workers, poll=args.poll, FAIRSHARE_EXPORTS_ROOT=str(Path(tmp.name) / "exports"))
    h.log(f"starting qcluster ({args.workers} workers, poll {args.poll}s); log {Path(tmp.name) / 'qcluster.log'}")
    from django.utils import timezone

    from scheduling import processes

    since = timezone.now()
    cluster = h.start_cluster(env, Path(tmp.name) / "qcluster.log")
    # Until its workers beat: before that none counts as running, and every job would wait in line
    # (budgets.ledger.idle_workers), which a drained broker does not show.
    processes.wait_ready([cluster], {"default": args.workers}, since=since)
    rounds = []
    try:
        for path in PATHS:  # warm-up (not measured): workers forked, modules imported
            run_path(path, 50, account_id, f"warm-{path}", cluster)
        for r in range(args.rounds):
            result = {"order": list(PATHS[r % 2:] + PATHS[:r % 2])}
            for path in result["order"]:
                time.sleep(1.0)  # let the previous path's tail settle
                result[path] = run_path(path, args.tasks, account_id, f"r{r}-{path}", cluster)
                h.log(f"round {r + 1}: {path:4s} {result[path]['tasks_per_s']:7.1f} tasks/s "
                      f"(enqueue {result[path]['enqueue_per_s']:.0f}/s)")
            result["ratio"] = result["task"]["tasks_per_s"] / result["job"]["tasks_per_s"]
            rounds.append(result)
            h.reset_tables(*TABLES)  # same table sizes every round
    finally:
        cluster.stop()
    return rounds


def report(args, info: dict, enqueue: dict, executed: dict, rounds: list[dict]) -> dict:
    tps = {path: h.median([r[path]["tasks_per_s"] for r in rounds]) for path in PATHS}
    cpu = {path: h.median([r[path]["machine_cpu_ms_per_task"] for r in rounds]) for path in PATHS}
    enqueue_ratio = enqueue["job"]["median_ms"] / enqueue["task"]["median_ms"]
    run_ratio = executed["job"]["median_wall_ms"] / executed["task"]["median_wall_ms"]
    ratio = tps["task"] / tps["job"]
    goals = {
        "enqueue": {"goal": f"task / job enqueues per second >= {GOAL_RATIO}", "value": enqueue_ratio,
                    "pass": enqueue_ratio >= GOAL_RATIO},
        "throughput": {"goal": f"task / job tasks per second through the cluster >= {GOAL_RATIO}", "value": ratio,
                       "pass": ratio >= GOAL_RATIO},
    }
    rows = [[path, h.fmt(enqueue[path]["median_ms"], ".3f"), str(len(enqueue[path]["statements"])),
             h.fmt(executed[path]["median_wall_ms"], ".3f"), h.fmt(executed[path]["median_cpu_ms"], ".3f"),
             h.fmt(tps[path], ".1f"), h.fmt(cpu[path], ".2f")] for path in PATHS]
    rows.append(["task / job", h.fmt(enqueue_ratio, ".2f") + " (rate)", "", h.fmt(run_ratio, ".2f") + " (rate)", "",
                 h.fmt(ratio, ".2f"), ""])
    print()
    print(h.render_table(["path", "enqueue ms (med)", "SQL per enqueue", "run in-process ms", "its CPU ms",
                          "tasks/s through the cluster (med)", "machine CPU ms/task"], rows,
                         right={1, 2, 3, 4, 5, 6}))
    print()
    round_rows = [[str(i + 1), path, h.fmt(r[path]["seconds"], ".2f"), h.fmt(r[path]["tasks_per_s"], ".1f"),
                   h.fmt(r[path]["enqueue_per_s"], ".0f")] for i, r in enumerate(rounds) for path in r["order"]]
    print(h.render_table(["round", "path", "seconds", "tasks/s", "enqueued/s (cluster running)"], round_rows,
                         right={0, 2, 3, 4}))
    for g in goals.values():
        print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {g['value']:.2f}")
    return {"benchmark": "tasks_overhead", "timestamp": h.utc_timestamp(),
            "parameters": {"tasks": args.tasks, "rounds": args.rounds, "workers": args.workers, "poll_s": args.poll,
                           "quick": args.quick, "broker": "orm",
                           "job": f"scheduling.runtime.enqueue(job={JOB!r}) for one account",
                           "task": "bench.tasks_noop.noop.enqueue(account=) for the same account"},
            "machine": info, "summary": {"enqueue_ms": {p: enqueue[p]["median_ms"] for p in PATHS},
                                         "enqueue_ratio": enqueue_ratio,
                                         "run_in_process_ms": {p: executed[p]["median_wall_ms"] for p in PATHS},
                                         "run_in_process_cpu_ms": {p: executed[p]["median_cpu_ms"] for p in PATHS},
                                         "run_in_process_ratio": run_ratio, "tasks_per_s": tps, "ratio": ratio,
                                         "machine_cpu_ms_per_task": cpu},
            "enqueue": enqueue, "in_process": executed, "rounds": rounds, "goals": goals}


def main(argv=None) -> int:
    args = parse_args(argv)
    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop, test_jobs=False)
    info = h.machine_info(db_url)
    account_id = setup_account()
    h.reset_tables(*TABLES)
    h.log(f"database {h.redact_url(db_url)}; {args.tasks} tasks per path, {args.rounds} rounds")
    enqueue = measure_enqueue(args.tasks, args.rounds, account_id)
    h.log(f"enqueue: job {enqueue['job']['median_ms']:.3f} ms, task {enqueue['task']['median_ms']:.3f} ms")
    executed = measure_execute(min(args.tasks, 500), args.rounds, account_id)
    h.log(f"in-process run: job {executed['job']['median_cpu_ms']:.3f} ms CPU, "
          f"task {executed['task']['median_cpu_ms']:.3f} ms CPU")
    rounds = through_cluster(args, account_id)
    results = report(args, info, enqueue, executed, rounds)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    h.print_load(results)
    h.write_results(args.json, results)
    return 1 if args.strict and not all(g["pass"] for g in results["goals"].values()) else 0


if __name__ == "__main__":
    h.run(main)
