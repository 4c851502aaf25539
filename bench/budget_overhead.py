#!/usr/bin/env python
"""What Fairshare's task chain costs against bare django-q2, on PostgreSQL with the ORM broker.

    .venv/bin/python bench/budget_overhead.py            # 2,000 tasks per path, 3 rounds
    .venv/bin/python bench/budget_overhead.py --quick    # 300 tasks per path, 2 rounds
    .venv/bin/python bench/budget_overhead.py --tasks 5000 --rounds 5 --workers 2

Three paths through the same real `manage.py qcluster` (2 workers, ORM broker, the benchmark's own
database), in the same run, each going first in turn:

- bare:  `async_task("bench.noop.noop", <an envelope-sized dict>)` N times;
- chain: `scheduling.runtime.enqueue(job="scheduling.noop", ...)` N times for one account whose budget
  cannot run out and whose cap does not bind (cpu_seconds_per_day 10^9, max_concurrent 32767; a
  job sent to the broker holds a slot until it starts, so a cap below N would hold most of the
  burst in the holding area — that path is what bench/fairness.py measures): the enqueue-time
  check (a dispatched slot; once a job sent to the broker has waited 0.25 s for a worker, every
  worker being busy, the job joins the account's line instead and the workers' loops run it
  without a message of its own), then in the worker the whole middleware chain (contract, TaskRun
  recording and metering, admission, heartbeat thread, RLIMIT_CPU, settlement) around a handler
  that does nothing;
- recorded: `async_task("bench.noop.recorded", <the envelope dict>)` N times: a bare function
  that only inserts its TaskRun and completes it (two statements). Not a goal: what any chain
  that keeps a TaskRun per run (written as it starts, completed as it ends) must pay at the least,
  so recorded / bare bounds what chain / bare can reach on the machine.

Each path is timed from its first enqueue until the broker holds none of its messages any more
(django-q2's monitor deletes the OrmQ row when it acknowledges a finished task; polled every 10 ms)
and, for the chain, the holding area none of its jobs.
The same end point serves every path, so nothing is added to the bare function. For the chain the
last TaskRun's finished_at is reported too. tasks/s = N / that time; the ratio is chain / bare
(and recorded / bare beside it).
Alongside, the CPU the whole machine spent busy over the same stretch, per task (/proc/stat: the
benchmark's producer, every cluster process and PostgreSQL together).

Before the cluster starts, the same account's admission and settlement are timed in this process
(`budgets.admission.admit` then `budgets.settlement.settle`, --iterations times, each job sent first by the
enqueue-time check `admit_at_enqueue`, timed too, as a worker receives it), the whole chain
(`scheduling.runtime.execute` of a job so sent) and a new database connection for comparison,
and the SQL statements and connections one chain run makes.

Goal printed: chain / bare tasks/s >= 0.9. Results: a table on stdout, JSON in bench/results/.
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
DEFAULT_DB_NAME = "fairshare_bench_budget"
ACCOUNT_SLUG = "bench-overhead"
QUEUE = "default"
BARE_FUNC = "bench.noop.noop"
RECORDED_FUNC = "bench.noop.recorded"
CHAIN_JOB = "scheduling.noop"
DRAIN_TIMEOUT_S = 900
PATHS = ("bare", "chain", "recorded")
SLOTS = 32767  # Budget.max_concurrent's largest value: the cap never binds here


# --- Set-up -------------------------------------------------------------------------------------

def setup_account(slug: str = ACCOUNT_SLUG) -> int:
    from budgets.models import Account, Budget, Plan

    account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": f"Benchmark {slug}", "plan": Plan.ENTERPRISE})
    Budget.objects.update_or_create(
        account=account, queue=QUEUE,
        defaults={"cpu_seconds_per_day": 10**9, "max_concurrent": SLOTS},
    )
    return account.pk


def envelope_message(account_id: int, ref: str) -> dict:
    return {"v": 1, "job": CHAIN_JOB, "account": account_id, "ref": ref}


def sent_message(account_id: int, ref: str) -> dict:
    """A job's message as a worker receives it: sent with a slot of its own (the enqueue-time
    check's), as `enqueue` leaves it."""
    from budgets.admission import admit_at_enqueue
    from scheduling.envelope import Envelope

    assert admit_at_enqueue(envelope=Envelope(job=CHAIN_JOB, account=account_id, ref=ref), queue=QUEUE)
    return envelope_message(account_id, ref)


# --- In-process: admission, settlement, the chain -----------------------------------------------

def measure_in_process(account_id: int, iterations: int) -> dict:
    from django.db import close_old_connections, connection
    from django.db.backends.signals import connection_created
    from django.test.utils import CaptureQueriesContext

    from scheduling.metering import Meter
    from budgets.admission import admit, admit_at_enqueue
    from budgets.settlement import settle
    from scheduling.envelope import Envelope
    from scheduling.runtime import execute
    from scheduling.services import task_run_new

    def new_run(envelope: Envelope):  # as the run recording gives it to admission: not saved yet
        return task_run_new(job=envelope.job, queue=QUEUE, account_id=envelope.account, ref=envelope.ref)

    def stopped_meter() -> Meter:
        m = Meter()
        m.stop()  # its figures are final from here on: settle charges what we set below
        m.cpu_ms, m.wall_ms, m.peak_rss_kb = 1, 1, 0
        return m

    warmup = min(20, iterations)
    admit_ms, settle_ms, both_ms, hold_ms, chain_ms, connect_ms = [], [], [], [], [], []
    for i in range(warmup + iterations):
        envelope = Envelope(job=CHAIN_JOB, account=account_id, ref=f"inproc-{i}")
        meter = stopped_meter()  # made before the clock starts: settle's time is settle's alone
        # In a job's order: the enqueue-time check takes a slot, admission takes it over.
        t0 = time.perf_counter()
        sent = admit_at_enqueue(envelope=envelope, queue=QUEUE)
        t1 = time.perf_counter()
        assert sent
        a = admit(envelope=envelope, queue=QUEUE, estimate_ms=10, worker="bench", run=new_run(envelope))
        t2 = time.perf_counter()
        assert a.admitted, a
        settle(slot_id=a.slot_id, account_id=account_id, queue=QUEUE, meter=meter)
        t3 = time.perf_counter()
        if i >= warmup:
            hold_ms.append((t1 - t0) * 1000)
            admit_ms.append((t2 - t1) * 1000)
            settle_ms.append((t3 - t2) * 1000)
            both_ms.append((t3 - t1) * 1000)

    # The whole chain as a worker runs it: django-q2 closes old connections before every task.
    chain_iterations = min(iterations, 300)
    for i in range(warmup + chain_iterations):
        close_old_connections()
        message = sent_message(account_id, f"inproc-chain-{i}")
        t0 = time.perf_counter()
        execute(message)
        t1 = time.perf_counter()
        if i >= warmup:
            chain_ms.append((t1 - t0) * 1000)
    for _ in range(50):
        connection.close()
        t0 = time.perf_counter()
        connection.ensure_connection()
        connect_ms.append((time.perf_counter() - t0) * 1000)

    # How many connections one chain run opens after django-q2's close_old_connections() (none
    # when connections persist: CONN_MAX_AGE > 0) ...
    connects = []
    counter = lambda sender, connection, **kw: connects.append(1)  # noqa: E731
    connection_created.connect(counter)
    try:
        close_old_connections()
        execute(sent_message(account_id, "inproc-connects"))
    finally:
        connection_created.disconnect(counter)
    # ... and what it sends to the database.
    close_old_connections()
    message = sent_message(account_id, "inproc-queries")
    with CaptureQueriesContext(connection) as queries:
        execute(message)
    logged = [q["sql"] for q in queries.captured_queries]
    # Django logs transaction control too: count the explicit transactions (COMMITs), and the
    # statements without BEGIN/COMMIT/ROLLBACK (outside a transaction each is its own).
    control = {"BEGIN", "COMMIT", "ROLLBACK"}
    statements = [sql for sql in logged if sql.strip().upper() not in control]
    transactions = sum(1 for sql in logged if sql.strip().upper() == "COMMIT")

    # Same for admit + settle alone, and the enqueue-time check.
    envelope = Envelope(job=CHAIN_JOB, account=account_id, ref="inproc-queries-2")
    with CaptureQueriesContext(connection) as q_hold:
        admit_at_enqueue(envelope=envelope, queue=QUEUE)
    with CaptureQueriesContext(connection) as q_admit:
        a = admit(envelope=envelope, queue=QUEUE, estimate_ms=10, worker="bench", run=new_run(envelope))
    with CaptureQueriesContext(connection) as q_settle:
        settle(slot_id=a.slot_id, account_id=account_id, queue=QUEUE, meter=stopped_meter())

    def stats(xs):
        return {"median_ms": h.median(xs), "p95_ms": h.percentile(xs, 95), "mean_ms": sum(xs) / len(xs), "n": len(xs)}

    return {
        "admit": stats(admit_ms), "settle": stats(settle_ms), "admit_plus_settle": stats(both_ms),
        "admit_at_enqueue": stats(hold_ms), "chain_execute": stats(chain_ms), "new_connection": stats(connect_ms),
        "statements": {
            "chain_execute": len(statements), "admit": len(q_admit.captured_queries),
            "settle": len(q_settle.captured_queries), "admit_at_enqueue": len(q_hold.captured_queries),
        },
        "chain_transactions": transactions,
        "connections_per_chain_execute": len(connects),  # after django-q2's close_old_connections()
        "conn_max_age": connection.settings_dict["CONN_MAX_AGE"],
        "chain_statement_log": [s[:160] for s in statements],
    }


# --- Through the cluster -----------------------------------------------------------------------

def _run_plain(func: str, n: int, account_id: int, tag: str, cluster: h.Cluster) -> dict:
    """`async_task(func, <envelope dict>)` n times, timed from the first enqueue until the broker
    is drained; a plain django-q2 function, outside the chain."""
    from django_q.tasks import async_task

    cpu0 = h.machine_cpu_seconds()
    t0 = time.perf_counter()
    for i in range(n):
        async_task(func, envelope_message(account_id, f"{tag}-{i}"), task_name=f"{func}:{tag}-{i}")
    t_enq = time.perf_counter()
    h.wait_until(h.broker_empty, timeout=DRAIN_TIMEOUT_S, what=f"{tag}: broker drained", cluster=cluster)
    seconds = time.perf_counter() - t0
    return {"tasks": n, "seconds": seconds, "tasks_per_s": n / seconds, "enqueue_s": t_enq - t0,
            "enqueue_per_s": n / (t_enq - t0), "machine_cpu_ms_per_task": _machine_cpu_ms_per_task(cpu0, n)}


def run_bare(n: int, account_id: int, tag: str, cluster: h.Cluster) -> dict:
    from django_q.models import Task

    failures_before = Task.objects.filter(success=False).count()
    result = _run_plain(BARE_FUNC, n, account_id, tag, cluster)
    failures = Task.objects.filter(success=False).count() - failures_before
    if failures:
        raise RuntimeError(f"{failures} bare tasks failed:\n{cluster.tail(40)}")
    return result


def run_recorded(n: int, account_id: int, tag: str, cluster: h.Cluster) -> dict:
    """The run's record alone (`bench.noop.recorded`): as `run_bare`, each task writing its TaskRun."""
    from scheduling.models import TaskRun

    result = _run_plain(RECORDED_FUNC, n, account_id, tag, cluster)
    done = TaskRun.objects.filter(ref__startswith=f"{tag}-", outcome="succeeded", finished_at__isnull=False).count()
    if done != n:
        raise RuntimeError(f"{tag}: expected {n} recorded runs, found {done}:\n{cluster.tail(40)}")
    return result


def _machine_cpu_ms_per_task(cpu0: float | None, n: int) -> float | None:
    """The whole machine's busy CPU since `cpu0` (h.machine_cpu_seconds), per task."""
    cpu1 = h.machine_cpu_seconds()
    return None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) * 1000 / n


def run_chain(n: int, account_id: int, tag: str, cluster: h.Cluster) -> dict:
    from django.db.models import Count
    from django.utils import timezone

    from scheduling.models import DeferredTask, TaskRun
    from scheduling.runtime import enqueue

    wall0 = timezone.now()
    cpu0 = h.machine_cpu_seconds()
    t0 = time.perf_counter()
    held = 0
    for i in range(n):
        # Sent, or held in the account's line while every worker is busy (the workers' loops run it).
        if enqueue(job=CHAIN_JOB, account=account_id, ref=f"{tag}-{i}") is None:
            held += 1
    t_enq = time.perf_counter()
    # A loop's message is acknowledged once the loop returned: an empty broker and an empty
    # holding area mean every job ran.
    h.wait_until(lambda: h.broker_empty() and not DeferredTask.objects.filter(ref__startswith=f"{tag}-").exists(),
                 timeout=DRAIN_TIMEOUT_S, what=f"{tag}: broker and holding area drained", cluster=cluster)
    t_end = time.perf_counter()
    cpu_ms = _machine_cpu_ms_per_task(cpu0, n)
    runs = TaskRun.objects.filter(job=CHAIN_JOB, ref__startswith=f"{tag}-")
    outcomes = dict(runs.values_list("outcome").annotate(c=Count("id")).order_by())
    if outcomes.get("succeeded", 0) != n or len(outcomes) != 1:
        raise RuntimeError(f"{tag}: expected {n} succeeded runs; got {outcomes}, {held} held at enqueue")
    rows = list(runs.values_list("started_at", "finished_at", "wall_ms", "cpu_ms", "db_wait_ms"))
    last_finished = max(r[1] for r in rows)
    in_worker_ms = [(r[1] - r[0]).total_seconds() * 1000 for r in rows]
    seconds = t_end - t0
    to_last_run = (last_finished - wall0).total_seconds()
    return {
        "tasks": n, "seconds": seconds, "tasks_per_s": n / seconds, "held_at_enqueue": held,
        "enqueue_s": t_enq - t0, "enqueue_per_s": n / (t_enq - t0), "machine_cpu_ms_per_task": cpu_ms,
        "to_last_taskrun_s": to_last_run, "tasks_per_s_to_last_taskrun": n / to_last_run,
        "taskrun_start_to_finish_ms": {"median": h.median(in_worker_ms), "p95": h.percentile(in_worker_ms, 95)},
        "taskrun_wall_ms_median": h.median([r[2] for r in rows]),
        "taskrun_cpu_ms_median": h.median([r[3] for r in rows]),
        "taskrun_db_wait_ms_median": h.median([r[4] for r in rows]),
    }


def print_db_activity(rounds: list[dict], tasks: int) -> None:
    """Backend milliseconds per task, by what the backends were doing (summed over rounds)."""
    totals: dict[str, dict[str, float]] = {"bare": {}, "chain": {}}
    statements: dict[str, float] = {}
    n = {"bare": 0, "chain": 0}
    for r in rounds:
        for path in ("bare", "chain"):
            activity = r[path].get("db_activity")
            if not activity:
                continue
            n[path] += tasks
            for kind, secs in activity["backend_seconds"].items():
                totals[path][kind] = totals[path].get(kind, 0) + secs
            if path == "chain":
                for stmt, secs in activity["top_statements_backend_seconds"].items():
                    statements[stmt] = statements.get(stmt, 0) + secs
    kinds = sorted(set(totals["bare"]) | set(totals["chain"]), key=lambda k: -totals["chain"].get(k, 0))
    rows = [[k, h.fmt(totals["bare"].get(k, 0) * 1000 / max(n["bare"], 1), ".2f"),
             h.fmt(totals["chain"].get(k, 0) * 1000 / max(n["chain"], 1), ".2f")] for k in kinds]
    print(h.render_table(["database backends (sampled every 20 ms)", "bare ms/task", "chain ms/task"], rows, right={1, 2}))
    print()
    top = sorted(statements.items(), key=lambda kv: -kv[1])[:10]
    rows = [[stmt[:130], h.fmt(secs * 1000 / max(n["chain"], 1), ".2f")] for stmt, secs in top]
    print(h.render_table(["chain: busiest statements (state | query)", "ms/task"], rows, right={1}))
    print()


# --- Main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 300 tasks per path, 2 rounds")
    p.add_argument("--tasks", type=int, help="tasks per path and round (default 2000; 300 with --quick)")
    p.add_argument("--rounds", type=int, help="rounds, alternating which path goes first (default 3; 2 with --quick)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--poll", type=float, default=0.1, help="FAIRSHARE_POLL of the cluster (seconds)")
    p.add_argument("--iterations", type=int, default=500, help="in-process admit+settle iterations")
    p.add_argument("--sample-waits", action="store_true",
                   help="sample pg_stat_activity every 20 ms during each path (where the database time goes)")
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--fresh", action="store_true", help="drop and recreate the benchmark database first")
    p.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    p.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    p.add_argument("--json", type=Path, help="results file (default bench/results/budget_overhead[-quick].json)")
    args = p.parse_args(argv)
    args.tasks = args.tasks or (300 if args.quick else 2000)
    args.rounds = args.rounds or (2 if args.quick else 3)
    args.json = args.json or h.RESULTS_DIR / ("budget_overhead-quick.json" if args.quick else "budget_overhead.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop, test_jobs=False)
    from django.db import close_old_connections

    info = h.machine_info(db_url)
    account_id = setup_account()
    h.reset_tables(*h.RUN_TABLES)
    log = h.log
    log(f"database {h.redact_url(db_url)}; {args.tasks} tasks per path, {args.rounds} rounds, {args.workers} workers")

    log(f"in-process: admit + settle, admit_at_enqueue x {args.iterations}; chain execute x {min(args.iterations, 300)}")
    inproc = measure_in_process(account_id, args.iterations)
    close_old_connections()
    h.reset_tables(*h.RUN_TABLES)

    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-")
    h.at_exit(tmp.cleanup)
    env = h.cluster_env(workers=args.workers, poll=args.poll, FAIRSHARE_EXPORTS_ROOT=str(Path(tmp.name) / "exports"))
    log_path = Path(tmp.name) / "qcluster.log"
    log(f"starting qcluster ({args.workers} workers, poll {args.poll}s); log {log_path}")
    cluster = h.start_cluster(env, log_path)
    rounds = []
    try:
        # Warm-up (not measured): workers forked, modules imported, both paths exercised.
        run_bare(50, account_id, "warm-bare", cluster)
        run_chain(50, account_id, "warm-chain", cluster)
        run_recorded(50, account_id, "warm-recorded", cluster)
        log(f"cluster ready (pid {cluster.pid})")
        for r in range(args.rounds):
            order = PATHS[r % 3:] + PATHS[:r % 3]  # each path first in turn
            result = {"order": list(order)}
            for path in order:
                time.sleep(1.0)  # let the previous path's tail (logging, recycling) settle
                run = {"bare": run_bare, "chain": run_chain, "recorded": run_recorded}[path]
                if args.sample_waits:
                    with h.WaitSampler(db_url) as sampler:
                        result[path] = run(args.tasks, account_id, f"r{r}-{path}", cluster)
                    result[path]["db_activity"] = sampler.summary()
                else:
                    result[path] = run(args.tasks, account_id, f"r{r}-{path}", cluster)
                log(f"round {r + 1}: {path:5s} {result[path]['tasks_per_s']:7.1f} tasks/s "
                    f"({result[path]['seconds']:.2f}s; enqueue {result[path]['enqueue_per_s']:.0f}/s)")
            result["ratio"] = result["chain"]["tasks_per_s"] / result["bare"]["tasks_per_s"]
            result["recorded_ratio"] = result["recorded"]["tasks_per_s"] / result["bare"]["tasks_per_s"]
            rounds.append(result)
            h.reset_tables("scheduling.TaskRun")  # same table sizes every round
    finally:
        log("stopping qcluster")
        cluster.stop()

    bare_tps, chain_tps, recorded_tps = (h.median([r[path]["tasks_per_s"] for r in rounds]) for path in PATHS)
    cpu = {path: [r[path]["machine_cpu_ms_per_task"] for r in rounds if r[path]["machine_cpu_ms_per_task"] is not None]
           for path in PATHS}
    bare_cpu, chain_cpu, recorded_cpu = (h.median(cpu[path]) if cpu[path] else None for path in PATHS)
    ratio = chain_tps / bare_tps
    recorded_ratio = recorded_tps / bare_tps
    per_task_overhead_ms = (1 / chain_tps - 1 / bare_tps) * 1000
    results = {
        "benchmark": "budget_overhead",
        "timestamp": h.utc_timestamp(),
        "parameters": {
            "tasks": args.tasks, "rounds": args.rounds, "workers": args.workers, "poll_s": args.poll,
            "quick": args.quick, "iterations": args.iterations, "broker": "orm", "save_limit": -1,
            "bare": f"async_task({BARE_FUNC!r}, <envelope-sized dict>)",
            "chain": f"scheduling.runtime.enqueue(job={CHAIN_JOB!r}) for one account "
                     f"(cpu_seconds_per_day 10^9, max_concurrent {SLOTS})",
            "recorded": f"async_task({RECORDED_FUNC!r}, <envelope dict>): a TaskRun inserted and completed, nothing else",
            "timing": "first enqueue -> broker drained (all OrmQ rows acknowledged; the chain: and its held "
                      "jobs run), polled every 10 ms; "
                      "median over rounds",
        },
        "machine": info,
        "summary": {
            "bare_tasks_per_s": bare_tps, "chain_tasks_per_s": chain_tps, "ratio": ratio,
            "chain_tasks_per_s_to_last_taskrun": h.median([r["chain"]["tasks_per_s_to_last_taskrun"] for r in rounds]),
            "per_task_overhead_ms_wall": per_task_overhead_ms,
            "bare_machine_cpu_ms_per_task": bare_cpu, "chain_machine_cpu_ms_per_task": chain_cpu,
            "recorded_tasks_per_s": recorded_tps, "recorded_ratio": recorded_ratio,
            "recorded_machine_cpu_ms_per_task": recorded_cpu, "chain_of_recorded": chain_tps / recorded_tps,
            "admit_plus_settle_ms": inproc["admit_plus_settle"],
        },
        "rounds": rounds,
        "in_process": inproc,
        "goals": {"ratio": {"goal": f"chain / bare tasks/s >= {GOAL_RATIO}", "value": ratio, "pass": ratio >= GOAL_RATIO}},
    }
    results["machine"]["loadavg_end"] = list(os.getloadavg())

    rows = []
    for i, r in enumerate(rounds):
        for path in r["order"]:
            x = r[path]
            rows.append([f"{i + 1}", path, f"{x['tasks']}", h.fmt(x["seconds"], ".2f"), h.fmt(x["tasks_per_s"], ".1f"),
                         h.fmt(x["enqueue_per_s"], ".0f"), h.fmt(x["machine_cpu_ms_per_task"], ".2f"),
                         h.fmt(x.get("taskrun_start_to_finish_ms", {}).get("median"), ".1f")])
        rows.append(["", "chain/bare", "", "", h.fmt(r["ratio"], ".2f"), "", "", ""])
        rows.append(["", "recorded/bare", "", "", h.fmt(r["recorded_ratio"], ".2f"), "", "", ""])
    rows.append(None)
    rows.append(["med", "bare", "", "", h.fmt(bare_tps, ".1f"), "", h.fmt(bare_cpu, ".2f"), ""])
    rows.append(["med", "chain", "", "", h.fmt(chain_tps, ".1f"), "", h.fmt(chain_cpu, ".2f"), ""])
    rows.append(["med", "recorded", "", "", h.fmt(recorded_tps, ".1f"), "", h.fmt(recorded_cpu, ".2f"), ""])
    rows.append(["med", "chain/bare", "", "", h.fmt(ratio, ".2f"), "", "", ""])
    rows.append(["med", "recorded/bare", "", "", h.fmt(recorded_ratio, ".2f"), "", "", ""])
    print()
    print(h.render_table(["round", "path", "tasks", "seconds", "tasks/s", "enqueued/s", "machine CPU ms/task",
                          "run ms (med)"], rows, right={0, 2, 3, 4, 5, 6, 7}))
    print()
    ip_rows = []
    for key, label in [("admit", "admit"), ("settle", "settle"), ("admit_plus_settle", "admit + settle"),
                       ("admit_at_enqueue", "admit_at_enqueue (enqueue-time check)"),
                       ("chain_execute", f"whole chain: execute({CHAIN_JOB})"),
                       ("new_connection", "new DB connection (ensure_connection)")]:
        s = inproc[key]
        ip_rows.append([label, h.fmt(s["median_ms"], ".2f"), h.fmt(s["p95_ms"], ".2f"), str(s["n"]),
                        str(inproc["statements"].get(key, "")) if key in inproc["statements"] else
                        (str(inproc["statements"]["chain_execute"]) if key == "chain_execute" else "")])
    print(h.render_table(["in-process, one account", "median ms", "p95 ms", "n", "SQL stmts"], ip_rows,
                         right={1, 2, 3, 4}))
    print(f"(one chain run opens {inproc['connections_per_chain_execute']} new database connection(s); "
          f"CONN_MAX_AGE is {inproc['conn_max_age']})")
    print(f"per task in the worker: {inproc['statements']['chain_execute']} SQL statements, "
          f"{inproc['chain_transactions']} explicit transactions (goal <= 6 and <= 2)")
    print()
    if args.sample_waits:
        print_db_activity(rounds, args.tasks)
    print(f"per-task wall overhead of the chain through the cluster: {per_task_overhead_ms:.2f} ms "
          f"(1/chain - 1/bare); admit + settle in-process median "
          f"{inproc['admit_plus_settle']['median_ms']:.2f} ms, p95 {inproc['admit_plus_settle']['p95_ms']:.2f} ms")
    g = results["goals"]["ratio"]
    print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {ratio:.2f} "
          f"(bare {bare_tps:.1f}/s, chain {chain_tps:.1f}/s, median of {args.rounds} rounds)")
    print(f"the run's record alone (recorded): {recorded_ratio:.2f} of bare; the chain reaches "
          f"{chain_tps / recorded_tps:.2f} of that")
    h.print_load(results)

    h.write_results(args.json, results)
    return 1 if args.strict and not g["pass"] else 0


if __name__ == "__main__":
    h.run(main)
