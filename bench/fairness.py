#!/usr/bin/env python
"""Does a flood from one account delay another account's jobs? (SPEC §4 Budgets and fairness)

    .venv/bin/python bench/fairness.py            # A floods 2,000 jobs
    .venv/bin/python bench/fairness.py --quick    # A floods 300 jobs
    .venv/bin/python bench/fairness.py --flood 5000 --job-ms 0   # scheduling.noop instead of tests.sleep

One real `manage.py qcluster` (2 workers, ORM broker, the benchmark's own database) and two accounts:
A (max_concurrent 1) and B (max_concurrent 2), both with a daily CPU budget of 3,600 s.

1. solo:  B enqueues 50 jobs, one every 50 ms, through `scheduling.runtime.enqueue`;
2. flood: A starts enqueueing 2,000 jobs as fast as one process can (a child process), and once its
   first job is in, B enqueues 50 jobs again, one every 50 ms, while A's flood is enqueued and
   worked off. The benchmark then waits for A's flood to finish (to read A's ledger).

Jobs are `tests.sleep` with ref "20/<id>" (20 ms of sleep, no CPU) unless --job-ms 0 (`scheduling.noop`).
B's wait = its admitted TaskRun's started_at minus the time this process recorded just before the
enqueue call (a held-then-released job counts from its first enqueue). Reported: B's p50/p95/max
wait in both phases; A's CPU used against its daily cap (UsageDay.cpu_used_ms vs
cpu_seconds_per_day), its concurrency (sampled active reservations vs max_concurrent), its runs,
deferrals and the worker passes spent deferring it; the broker depth and A's holding area, sampled.

Goal printed: B's p95 wait during the flood <= 2x its solo p95.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

GOAL_FACTOR = 2.0
DEFAULT_DB_NAME = "fairshare_bench_fairness"
QUEUE = "default"
B_TIMEOUT_S = 300


def job_name(job_ms: int) -> str:
    return "tests.sleep" if job_ms > 0 else "scheduling.noop"


def ref(job_ms: int, name: str) -> str:
    return f"{job_ms}/{name}"


def setup_accounts(args) -> tuple[int, int]:
    from budgets.models import Account, Budget, Plan

    ids = []
    for slug, cap, cpu in (("bench-a", args.a_cap, args.a_cpu_seconds), ("bench-b", args.b_cap, args.b_cpu_seconds)):
        account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug, "plan": Plan.STANDARD})
        Budget.objects.update_or_create(account=account, queue=QUEUE,
                                        defaults={"cpu_seconds_per_day": cpu, "max_concurrent": cap})
        ids.append(account.pk)
    return ids[0], ids[1]


# --- The flood (a child process) -----------------------------------------------------------------

def child_flood(n: int, account_id: int, job_ms: int) -> None:
    """Enqueue A's flood as fast as one process can; report progress and a summary on stdout."""
    h.setup_django()
    from scheduling.runtime import enqueue

    job = job_name(job_ms)
    held = 0
    t0 = time.perf_counter()
    for i in range(n):
        if enqueue(job=job, account=account_id, ref=ref(job_ms, f"a-{i}")) is None:
            held += 1
        if i == 0 or (i + 1) % 50 == 0:
            print(f"progress {i + 1}", flush=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"enqueued": n, "held_at_enqueue": held, "sent": n - held, "seconds": seconds}), flush=True)


class Flood:
    def __init__(self, n: int, account_id: int, job_ms: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child-flood", str(n),
             "--child-account", str(account_id), "--job-ms", str(job_ms)],
            cwd=h.REPO, env=dict(os.environ), stdout=subprocess.PIPE, text=True,
        )
        self.progress = 0
        self.summary: dict | None = None
        self.first_enqueued = threading.Event()
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        h.at_exit(self.kill)

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("progress "):
                self.progress = int(line.split()[1])
                self.first_enqueued.set()
            elif line.startswith("{"):
                self.summary = json.loads(line)
                self.finished_at = time.perf_counter()
        self.first_enqueued.set()

    def wait(self, timeout: float) -> dict:
        self.proc.wait(timeout)
        self._reader.join(5)
        if self.proc.returncode != 0 or self.summary is None:
            raise RuntimeError(f"the flood process failed ({self.proc.returncode})")
        return self.summary

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


# --- Sampling and B's jobs ------------------------------------------------------------------------

class Sampler:
    """Every 100 ms: broker depth, A's holding area, active reservations of A and B."""

    def __init__(self, a_id: int, b_id: int, interval: float = 0.1):
        self.a_id, self.b_id, self.interval = a_id, b_id, interval
        self.rows: list[tuple[float, int, int, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        from django.db import connection

        sql = """
            SELECT (SELECT count(*) FROM django_q_ormq),
                   (SELECT count(*) FROM scheduling_deferredtask WHERE account_id = %s),
                   (SELECT count(*) FROM budgets_reservation WHERE account_id = %s AND status = 'active'),
                   (SELECT count(*) FROM budgets_reservation WHERE account_id = %s AND status = 'active')
        """
        try:
            while not self._stop.wait(self.interval):
                with connection.cursor() as cur:
                    cur.execute(sql, [self.a_id, self.a_id, self.b_id])
                    self.rows.append((time.perf_counter() - self._t0, *cur.fetchone()))
        finally:
            connection.close()

    def summary(self) -> dict:
        if not self.rows:
            return {}
        col = lambda i: [r[i] for r in self.rows]  # noqa: E731
        return {
            "samples": len(self.rows), "interval_s": self.interval,
            "broker_depth_max": max(col(1)), "broker_depth_median": h.median(col(1)),
            "a_held_max": max(col(2)),
            "a_active_reservations_max": max(col(3)), "b_active_reservations_max": max(col(4)),
        }


def run_b(phase: str, args, b_id: int, cluster: h.Cluster) -> dict:
    from django.utils import timezone

    from scheduling.models import TaskRun
    from scheduling.runtime import enqueue

    job = job_name(args.job_ms)
    refs, enqueued_at, held = [], {}, 0
    t0 = time.perf_counter()
    for i in range(args.b_jobs):
        target = t0 + i * args.b_spacing_ms / 1000
        delay = target - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        r = ref(args.job_ms, f"b-{phase}-{i}")
        enqueued_at[r] = timezone.now()
        if enqueue(job=job, account=b_id, ref=r) is None:
            held += 1
        refs.append(r)
    send_s = time.perf_counter() - t0

    def done():
        return TaskRun.objects.filter(job=job, ref__in=refs, outcome="succeeded").count() == len(refs)

    h.wait_until(done, timeout=B_TIMEOUT_S, interval=0.05, what=f"B's {phase} jobs", cluster=cluster)
    runs = list(TaskRun.objects.filter(job=job, ref__in=refs).values_list("ref", "outcome", "started_at", "finished_at"))
    started = {r: s for r, outcome, s, _ in runs if outcome == "succeeded"}
    last_finished = max(f for _, outcome, _, f in runs if outcome == "succeeded")
    deferred_runs = sum(1 for _, outcome, _, _ in runs if outcome == "deferred")
    waits_ms = [(started[r] - enqueued_at[r]).total_seconds() * 1000 for r in refs]
    # First enqueue to last finish: about the send window (50 x 50 ms) when the workers keep up
    # with B, much longer when B's jobs queue up (the phase is then not a light load).
    span_s = (last_finished - enqueued_at[refs[0]]).total_seconds()
    return {
        "jobs": len(refs), "held_at_enqueue": held, "deferred_runs": deferred_runs, "send_s": send_s,
        "span_s": span_s,
        "wait_ms": {"p50": h.median(waits_ms), "p95": h.percentile(waits_ms, 95), "max": max(waits_ms),
                    "min": min(waits_ms)},
        "waits_ms": [round(w, 1) for w in waits_ms],
    }


def a_report(args, a_id: int, flood_summary: dict, drain_s: float | None, drained: bool) -> dict:
    from django.db.models import Count

    from budgets import clock
    from budgets.models import Budget, UsageDay
    from scheduling.models import DeferredTask, TaskRun

    job = job_name(args.job_ms)
    budget = Budget.objects.get(account_id=a_id, queue=QUEUE)
    usage = UsageDay.objects.filter(account_id=a_id, queue=QUEUE, day=clock.budget_day()).first()
    outcomes = dict(TaskRun.objects.filter(account_id=a_id, job=job).values_list("outcome")
                    .annotate(c=Count("id")).order_by())
    limit_ms = budget.cpu_seconds_per_day * 1000
    used = usage.cpu_used_ms if usage else 0
    return {
        "flood": args.flood, "enqueue": flood_summary, "drained": drained, "drain_s": drain_s,
        "succeeded_at_end": outcomes.get("succeeded", 0),
        "held_at_end": DeferredTask.objects.filter(account_id=a_id).count(),
        "cpu_used_ms": used, "cpu_reserved_ms_at_end": usage.cpu_reserved_ms if usage else 0,
        "cpu_limit_ms": limit_ms, "cpu_used_fraction_of_cap": used / limit_ms,
        "runs": usage.runs if usage else 0, "deferrals": usage.deferrals if usage else 0,
        "max_concurrent": budget.max_concurrent,
        "taskruns_by_outcome": outcomes,
    }


# --- Main ---------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: A floods 300 jobs")
    p.add_argument("--flood", type=int, help="A's jobs (default 2000; 300 with --quick)")
    p.add_argument("--b-jobs", type=int, default=50)
    p.add_argument("--b-spacing-ms", type=float, default=50)
    p.add_argument("--job-ms", type=int, default=20, help="tests.sleep milliseconds; 0 = scheduling.noop")
    p.add_argument("--a-cap", type=int, default=1, help="A's max_concurrent")
    p.add_argument("--b-cap", type=int, default=2, help="B's max_concurrent")
    p.add_argument("--a-cpu-seconds", type=int, default=3600)
    p.add_argument("--b-cpu-seconds", type=int, default=3600)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--poll", type=float, default=0.1, help="FAIRSHARE_POLL of the cluster (seconds)")
    p.add_argument("--no-drain", action="store_true", help="do not wait for A's flood to finish")
    p.add_argument("--drain-timeout", type=float, default=480,
                   help="seconds after the flood starts to stop waiting for it to finish and report A as it "
                        "is (default 480)")
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--drop", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    p.add_argument("--json", type=Path, help="results file (default bench/results/fairness[-quick].json)")
    p.add_argument("--child-flood", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-account", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.flood = args.flood or (300 if args.quick else 2000)
    args.json = args.json or h.RESULTS_DIR / ("fairness-quick.json" if args.quick else "fairness.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_flood:
        child_flood(args.child_flood, args.child_account, args.job_ms)
        return 0
    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop)
    from budgets.models import UsageDay
    from scheduling.models import TaskRun

    log = h.log
    info = h.machine_info(db_url)
    a_id, b_id = setup_accounts(args)
    h.reset_tables(*h.RUN_TABLES)
    log(f"database {h.redact_url(db_url)}; A floods {args.flood} x {job_name(args.job_ms)} "
        f"({args.job_ms} ms); B sends {args.b_jobs} every {args.b_spacing_ms:.0f} ms")

    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-")
    h.at_exit(tmp.cleanup)
    env = h.cluster_env(workers=args.workers, poll=args.poll, FAIRSHARE_EXPORTS_ROOT=str(Path(tmp.name) / "exports"))
    log(f"starting qcluster ({args.workers} workers, poll {args.poll}s)")
    cluster = h.start_cluster(env, Path(tmp.name) / "qcluster.log")
    results = {
        "benchmark": "fairness", "timestamp": h.utc_timestamp(),
        "parameters": {
            "flood": args.flood, "b_jobs": args.b_jobs, "b_spacing_ms": args.b_spacing_ms,
            "job": job_name(args.job_ms), "job_ms": args.job_ms, "a_max_concurrent": args.a_cap,
            "b_max_concurrent": args.b_cap, "a_cpu_seconds_per_day": args.a_cpu_seconds,
            "b_cpu_seconds_per_day": args.b_cpu_seconds, "workers": args.workers, "poll_s": args.poll,
            "quick": args.quick, "broker": "orm",
            "b_starts": "when A's first job has been enqueued (A keeps enqueueing in a child process)",
            "wait": "TaskRun.started_at (admitted run) - time recorded just before enqueue()",
        },
        "machine": info,
    }
    try:
        # Warm-up (not measured): workers forked and modules imported.
        run_b("warm", argparse.Namespace(**{**vars(args), "b_jobs": 10}), b_id, cluster)
        h.wait_until(h.broker_empty, timeout=60, what="broker empty after warm-up", cluster=cluster)
        time.sleep(1)
        log(f"cluster ready (pid {cluster.pid})")

        with Sampler(a_id, b_id) as solo_sampler:
            solo = run_b("solo", args, b_id, cluster)
        solo["sampled"] = solo_sampler.summary()
        log(f"solo:  B wait p50 {solo['wait_ms']['p50']:.0f} ms, p95 {solo['wait_ms']['p95']:.0f} ms")
        h.wait_until(h.broker_empty, timeout=60, what="broker empty after the solo phase", cluster=cluster)
        time.sleep(1)

        with Sampler(a_id, b_id) as flood_sampler:
            t_flood = time.perf_counter()
            flood = Flood(args.flood, a_id, args.job_ms)
            flood.first_enqueued.wait(120)
            during = run_b("flood", args, b_id, cluster)
            log(f"flood: B wait p50 {during['wait_ms']['p50']:.0f} ms, p95 {during['wait_ms']['p95']:.0f} ms "
                f"(A had enqueued {flood.progress} of {args.flood} when B's last job started)")
            flood_summary = flood.wait(900)
            log(f"A's flood enqueued in {flood_summary['seconds']:.1f}s: {flood_summary['sent']} sent to the broker, "
                f"{flood_summary['held_at_enqueue']} held at enqueue")
            drained, drain_s = False, None
            if not args.no_drain:
                job = job_name(args.job_ms)

                def a_done():
                    return TaskRun.objects.filter(account_id=a_id, job=job, outcome="succeeded").count() >= args.flood

                try:
                    h.wait_until(a_done, timeout=max(1.0, args.drain_timeout - (time.perf_counter() - t_flood)), interval=0.25, what="A's flood", cluster=cluster)
                    drained, drain_s = True, time.perf_counter() - t_flood
                    log(f"A's flood finished {drain_s:.1f}s after it started")
                except TimeoutError as exc:
                    log(f"WARNING: {exc}; reporting A as it is")
        during["sampled"] = flood_sampler.summary()
        a = a_report(args, a_id, flood_summary, drain_s, drained)
    finally:
        log("stopping qcluster")
        cluster.stop()

    ratio = during["wait_ms"]["p95"] / solo["wait_ms"]["p95"]
    results.update({
        "solo": solo, "flood": during, "a": a,
        "b_usage": dict(UsageDay.objects.filter(account_id=b_id, queue=QUEUE).values("cpu_used_ms", "runs", "deferrals").first() or {}),
        "goals": {"fairness": {"goal": f"B's p95 wait during A's flood <= {GOAL_FACTOR:g}x its solo p95",
                               "value": ratio, "pass": ratio <= GOAL_FACTOR}},
    })
    results["machine"]["loadavg_end"] = list(os.getloadavg())

    rows = []
    for name, phase in (("B solo", solo), ("B during A's flood", during)):
        w = phase["wait_ms"]
        rows.append([name, str(phase["jobs"]), h.fmt(w["p50"], ".0f"), h.fmt(w["p95"], ".0f"), h.fmt(w["max"], ".0f"),
                     f"{phase['send_s']:.1f} / {phase['span_s']:.1f}", str(phase["deferred_runs"]), str(phase["sampled"].get("broker_depth_max", "-")),
                     str(phase["sampled"].get("a_held_max", "-"))])
    print()
    print(h.render_table(["phase", "jobs", "wait p50 ms", "wait p95 ms", "max ms", "sent / done s", "B deferred runs",
                          "broker depth max", "A held max"], rows, right={1, 2, 3, 4, 5, 6, 7, 8}))
    print("(sent / done: B's send window and its first enqueue -> last finish; done >> sent means B's own "
          "jobs queued up, i.e. the workers could not keep up with B)")
    print()
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(a["taskruns_by_outcome"].items()))
    a_rows = [
        ["flood enqueued", f"{args.flood} in {a['enqueue']['seconds']:.1f}s: {a['enqueue']['sent']} to the broker, "
                           f"{a['enqueue']['held_at_enqueue']} held at enqueue"],
        ["flood finished", f"{a['drain_s']:.1f}s after it started" if a["drained"] else
         f"not yet: {a['succeeded_at_end']} of {args.flood} done, {a['held_at_end']} held, when the benchmark stopped "
         f"waiting (--drain-timeout {args.drain_timeout:.0f}s)"],
        ["CPU used vs daily cap", f"{a['cpu_used_ms']} ms of {a['cpu_limit_ms']} ms "
                                  f"({a['cpu_used_fraction_of_cap'] * 100:.2f}%); reserved at end {a['cpu_reserved_ms_at_end']} ms"],
        ["concurrency vs cap", f"max {during['sampled'].get('a_active_reservations_max', '-')} active reservations "
                               f"sampled (cap {a['max_concurrent']})"],
        ["ledger", f"{a['runs']} runs, {a['deferrals']} deferrals"],
        ["TaskRuns", outcomes],
    ]
    print(h.render_table(["account A", ""], a_rows, right=set()))
    print()
    g = results["goals"]["fairness"]
    print(f"{'PASS' if g['pass'] else 'MISS'}  {g['goal']}: {during['wait_ms']['p95']:.0f} ms vs "
          f"{solo['wait_ms']['p95']:.0f} ms solo = {ratio:.2f}x")
    h.print_load(results)
    h.write_results(args.json, results)
    return 1 if args.strict and not g["pass"] else 0


if __name__ == "__main__":
    h.run(main)
