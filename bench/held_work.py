#!/usr/bin/env python
"""Does held work cost the others anything? (SPEC §4 "Held work costs nothing")

    .venv/bin/python bench/held_work.py           # nothing held; 10k, 100k, 1M held across 10, 400, 10,000 accounts
    .venv/bin/python bench/held_work.py --quick   # nothing held; 10k across 10; 100k across 400; 1M across 10,000

For each size, a fresh holding area: other accounts with no CPU budget left today
(cpu_seconds_per_day = 0) each send their share of the held jobs through `enqueue_many` (chunks
of 2,500), all of it held until tomorrow; then VACUUM ANALYZE, as autovacuum leaves a database in
use (and not during the measurement). One
real `manage.py qcluster` of the default queue (2 workers, the product's defaults) then runs, in
the benchmark's own database:

1. idle: the machine's CPU (every process: cluster, PostgreSQL, this one asleep) over --idle-s
   seconds with nothing to run, in cores;
2. B (cap 2) sends 40 jobs of 20 ms, one every 50 ms: its wait (admitted run's start minus the
   time just before `enqueue`), p95;
3. A (cap 1) works off 300 jobs of 20 ms queued behind one long job (1 s): its jobs/s, from the
   first short job's start to the last one's finish, and the PostgreSQL processes' CPU over
   that stretch per job;
4. in this process: one job of B's through the whole chain (`execute`), as a worker runs it:
   statements and milliseconds (median of 30).

Printed side by side with the empty holding area's figures (ratios within one run); goal at
1,000,000 held across 10,000 accounts: B's p95 <= 1.25x and A's jobs/s >= 0.9x of the empty
figures, idle CPU <= 0.02 cores above it. Results in bench/results/held_work[-quick].json.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import fairness  # noqa: E402
from bench import harness as h  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_held_work"
FULL = [(0, 0), (10_000, 10), (10_000, 400), (10_000, 10_000), (100_000, 10), (100_000, 400), (100_000, 10_000),
        (1_000_000, 10), (1_000_000, 400), (1_000_000, 10_000)]
QUICK = [(0, 0), (10_000, 10), (100_000, 400), (1_000_000, 10_000)]
CHUNK = 2500
GOALS = {"b_p95": 1.25, "a_rate": 0.9, "idle_cores": 0.02}


def fresh_accounts() -> tuple[int, int]:
    """Every account and what hangs on it gone (and the holding area's counts with it); A and B anew."""
    from django.db import connection

    from budgets.models import Account, Budget

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE budgets_account, scheduling_backlog, django_q_ormq, django_q_task CASCADE")
    ids = []
    for slug, cap in (("held-a", 1), ("held-b", 2)):
        account = Account.objects.create(slug=slug, name=slug)
        Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=cap)
        ids.append(account.pk)
    return ids[0], ids[1]


def hold_work(held: int, accounts: int) -> float:
    """`accounts` accounts out of budget for today, `held` jobs between them, sent through
    `enqueue_many` and all held. Returns the seconds it took."""
    from django.db import connection

    from budgets.models import Account, Budget
    from scheduling.runtime import enqueue_many

    if not held:
        return 0.0
    t0 = time.perf_counter()
    spent = Account.objects.bulk_create([Account(slug=f"spent-{i}", name=f"spent {i}") for i in range(accounts)])
    Budget.objects.bulk_create([Budget(account=a, queue="default", cpu_seconds_per_day=0, max_concurrent=2)
                                for a in spent])
    each, extra = divmod(held, accounts)
    for n, account in enumerate(spent):
        jobs = [(account.pk, f"20/held-{account.pk}-{i}") for i in range(each + (1 if n < extra else 0))]
        for first in range(0, len(jobs), CHUNK):
            sent = enqueue_many(job="tests.sleep", work=jobs[first:first + CHUNK])
            assert not any(sent), "an account out of budget had a job sent"
    with connection.cursor() as cursor:  # as autovacuum would have left them by now (not during the run)
        cursor.execute("VACUUM ANALYZE")
    return time.perf_counter() - t0


def postgres_cpu_seconds() -> float:
    """CPU time of every PostgreSQL process on this machine (/proc)."""
    total = 0.0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("postgres"):
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def idle_cores(seconds: float) -> float:
    cpu0, t0 = h.machine_cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (h.machine_cpu_seconds() - cpu0) / (time.perf_counter() - t0)


def a_works_off(a_id: int, cluster) -> dict:
    """A's 300 short jobs behind one long one; jobs/s and PostgreSQL CPU per job."""
    from scheduling.models import TaskRun
    from scheduling.runtime import enqueue_many

    refs = [f"20/a-{i}" for i in range(300)]
    pg0 = postgres_cpu_seconds()
    enqueue_many(job="tests.sleep", work=[(a_id, "1000/a-long")] + [(a_id, r) for r in refs])
    h.wait_until(lambda: TaskRun.objects.filter(ref__in=refs, outcome="succeeded").count() == len(refs),
                 timeout=300, interval=0.1, what="A's backlog", cluster=cluster)
    pg_s = postgres_cpu_seconds() - pg0
    spans = list(TaskRun.objects.filter(ref__in=refs, outcome="succeeded").values_list("started_at", "finished_at"))
    span_s = (max(f for _, f in spans) - min(s for s, _ in spans)).total_seconds()
    return {"jobs": len(refs), "span_s": span_s, "jobs_per_s": len(refs) / span_s,
            "postgres_cpu_ms_per_job": pg_s * 1000 / (len(refs) + 1)}


def one_task_in_process(b_id: int) -> dict:
    """B's job through the chain in this process, as a worker runs it: statements and ms."""
    from django.db import close_old_connections, connection
    from django.test.utils import CaptureQueriesContext

    from django.utils import timezone

    from budgets.admission import admit_at_enqueue
    from scheduling.envelope import Envelope
    from scheduling.models import WorkerHeartbeat
    from scheduling.runtime import execute

    times, statements = [], []
    for i in range(40):
        # This process is the worker that runs it: its heartbeat says one worker of the queue is
        # free, else the enqueue check holds the job for a worker (budgets.ledger.idle_workers).
        WorkerHeartbeat.objects.update_or_create(worker="bench:in-process", queue="default",
                                                 defaults={"seen_at": timezone.now()})
        envelope = Envelope(job="tests.noop", account=b_id, ref=f"inproc-{i}")
        assert admit_at_enqueue(envelope=envelope, queue="default")
        close_old_connections()
        with CaptureQueriesContext(connection) as queries:
            t0 = time.perf_counter()
            execute(envelope.to_message())
            elapsed = time.perf_counter() - t0
        if i >= 10:  # warmed up: statements prepared on this connection
            times.append(elapsed * 1000)
            statements.append(sum(1 for q in queries.captured_queries
                                  if q["sql"].strip().upper() not in {"BEGIN", "COMMIT", "ROLLBACK"}))
    WorkerHeartbeat.objects.filter(worker="bench:in-process").delete()  # not one of the cluster's
    return {"statements": max(statements), "ms_median": h.median(times)}


def measure(held: int, accounts: int, args, tmp: Path) -> dict:
    from scheduling.models import Backlog, DeferredTask

    a_id, b_id = fresh_accounts()
    fill_s = hold_work(held, accounts)
    assert DeferredTask.objects.count() == held
    h.log(f"{held:,} held across {accounts:,} accounts ({fill_s:.0f} s to send them); "
          f"{Backlog.objects.filter(held__gt=0).count():,} backlogs")
    in_process = one_task_in_process(b_id)
    env = h.cluster_env(workers=2, poll=None, FAIRSHARE_EXPORTS_ROOT=str(tmp / "exports"))
    cluster = h.start_cluster(env, tmp / f"qcluster-{held}-{accounts}.log")
    try:
        b_args = argparse.Namespace(job_ms=20, b_jobs=10, b_spacing_ms=50)
        fairness.run_b("warm", b_args, b_id, cluster)  # workers forked, modules imported
        h.wait_until(h.broker_empty, timeout=60, what="the broker to empty", cluster=cluster)
        time.sleep(2)
        idle = idle_cores(args.idle_s)
        b = fairness.run_b(f"{held}-{accounts}", argparse.Namespace(job_ms=20, b_jobs=40, b_spacing_ms=50), b_id,
                           cluster)
        h.wait_until(h.broker_empty, timeout=60, what="the broker to empty", cluster=cluster)
        a = a_works_off(a_id, cluster)
    finally:
        cluster.stop()
    row = {"held": held, "accounts": accounts, "fill_s": fill_s, "idle_cores": idle, "b_wait_ms": b["wait_ms"],
           "a": a, "per_task": in_process}
    h.log(f"  B p95 {b['wait_ms']['p95']:.0f} ms, A {a['jobs_per_s']:.1f} jobs/s, idle {idle:.3f} cores, "
          f"{in_process['statements']} statements / {in_process['ms_median']:.2f} ms per task")
    return row


def report(rows: list[dict]) -> dict:
    empty = rows[0]
    table = []
    for r in rows:
        b_ratio = r["b_wait_ms"]["p95"] / empty["b_wait_ms"]["p95"]
        a_ratio = r["a"]["jobs_per_s"] / empty["a"]["jobs_per_s"]
        r["vs_empty"] = {"b_p95": b_ratio, "a_rate": a_ratio, "idle_cores_above": r["idle_cores"] - empty["idle_cores"]}
        table.append([f"{r['held']:,}", f"{r['accounts']:,}", f"{r['b_wait_ms']['p95']:.0f}", f"{b_ratio:.2f}x",
                      f"{r['a']['jobs_per_s']:.1f}", f"{a_ratio:.2f}x", str(r["per_task"]["statements"]),
                      f"{r['per_task']['ms_median']:.2f}", f"{r['a']['postgres_cpu_ms_per_job']:.2f}",
                      f"{r['idle_cores']:.3f}", f"{r['vs_empty']['idle_cores_above']:+.3f}"])
    print()
    print(h.render_table(["held", "accounts", "B p95 ms", "vs empty", "A jobs/s", "vs empty", "statements/task",
                          "worker ms/task", "PG CPU ms/task", "idle cores", "vs empty"], table,
                         right=set(range(11))))
    largest = max(rows, key=lambda r: (r["held"], r["accounts"]))
    v = largest["vs_empty"]
    goals = {
        "b_p95": {"goal": f"B's p95 <= {GOALS['b_p95']}x empty", "value": v["b_p95"], "pass": v["b_p95"] <= GOALS["b_p95"]},
        "a_rate": {"goal": f"A's jobs/s >= {GOALS['a_rate']}x empty", "value": v["a_rate"],
                   "pass": v["a_rate"] >= GOALS["a_rate"]},
        "idle": {"goal": f"idle CPU <= {GOALS['idle_cores']} cores above empty", "value": v["idle_cores_above"],
                 "pass": v["idle_cores_above"] <= GOALS["idle_cores"]},
    }
    print()
    for goal in goals.values():
        print(f"{'PASS' if goal['pass'] else 'MISS'}  at {largest['held']:,} held across {largest['accounts']:,} "
              f"accounts: {goal['goal']}: {goal['value']:.3f}")
    return goals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="four sizes instead of ten")
    p.add_argument("--idle-s", type=float, default=10, help="seconds of idle CPU measured per size")
    p.add_argument("--sizes", help="held:accounts,... instead of the default sizes (0:0 is always first)")
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    db_url = h.prepare(args.db_name, fresh=False, drop=False)
    tmp = tempfile.TemporaryDirectory(prefix="fairshare-held-")
    h.at_exit(tmp.cleanup)
    results = {"benchmark": "held_work", "timestamp": h.utc_timestamp(), "machine": h.machine_info(db_url),
               "parameters": {"sizes": QUICK if args.quick else FULL, "workers": 2, "b": "cap 2, 40 x 20 ms every 50 ms",
                              "a": "cap 1, 300 x 20 ms behind one of 1 s", "chunk": CHUNK, "idle_s": args.idle_s}}
    sizes = QUICK if args.quick else FULL
    if args.sizes:
        sizes = [(0, 0)] + [tuple(int(n) for n in size.split(":")) for size in args.sizes.split(",")]
    results["parameters"]["sizes"] = sizes
    rows = [measure(held, accounts, args, Path(tmp.name)) for held, accounts in sizes]
    results["rows"] = rows
    results["goals"] = report(rows)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    h.print_load(results)
    h.write_results(args.json or h.RESULTS_DIR / ("held_work-quick.json" if args.quick else "held_work.json"), results)
    return 0


if __name__ == "__main__":
    h.run(main)
