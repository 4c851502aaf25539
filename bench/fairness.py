#!/usr/bin/env python
"""Does a flood from one account delay another account's jobs? (SPEC §4 Budgets and fairness)

    .venv/bin/python bench/fairness.py            # A floods 2,000 jobs
    .venv/bin/python bench/fairness.py --quick    # A floods 300 jobs
    .venv/bin/python bench/fairness.py --flood 5000 --job-ms 0   # scheduling.noop instead of tests.sleep
    .venv/bin/python bench/fairness.py --cpu-hog 1  # with one busy process beside the cluster

One real `manage.py qcluster` (2 workers, ORM broker, the benchmark's own database) and two accounts:
A (max_concurrent 1) and B (max_concurrent 2), both with a daily CPU budget of 3,600 s.

1. solo:  B enqueues 50 jobs, one every 50 ms, through `scheduling.runtime.enqueue`;
2. work conservation: A's backlog of 400 jobs (sent for C, A's twin: same cap and budget) (`enqueue_many`, timed: the bulk enqueue cost per
   job) runs alone; A's jobs/s (first start to last finish) against the bound
   cap x 1000 / job ms, and the most of A's runs at once (recorded intervals, and sampled every 20 ms);
3. flood: A starts enqueueing 2,000 jobs as fast as one process can (a child process; `enqueue_many` in chunks
   of --flood-chunk, 100 by default, or 1: one `enqueue` per job), and once its
   first job is in, B enqueues 50 jobs again, one every 50 ms, while A's flood is enqueued and
   worked off. The benchmark then waits for A's flood to finish (to read A's ledger).

Jobs are `tests.sleep` with ref "20/<id>" (20 ms of sleep, no CPU) unless --job-ms 0 (`scheduling.noop`).
B's wait = its admitted TaskRun's started_at minus the time this process recorded just before the
enqueue call (a held-then-released job counts from its first enqueue). Reported: B's p50/p95/max
wait in both phases; A's CPU used against its daily cap (UsageDay.cpu_used_ms vs
cpu_seconds_per_day), its concurrency (sampled active reservations vs max_concurrent), its runs,
deferrals and the worker passes spent deferring it; the broker depth and A's holding area, sampled.

The cluster runs with the product's default broker poll (FAIRSHARE_POLL) unless --poll says otherwise.
Goals printed: B's p95 wait during the flood <= 1.5x its solo p95; B's solo p95 <= 300 ms; A's
backlog at >= 0.8 of its bound, never more than its cap at once.

4. tiers (bench/tiers.py, each with a cluster of its own; --tiers '' skips them): weights 1 : 3
   share worker time 1 : 3 within 10%; a rate limit of 10 starts/s is never passed, reached (>= 9/s)
   and leaves the other workers busy; 20 high-priority jobs start before the next 20 low ones.
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
from bench import tiers  # noqa: E402

GOAL_FACTOR = 1.5
SOLO_P95_GOAL_MS = 300
CONSERVATION_GOAL = 0.8
DEFAULT_DB_NAME = "fairshare_bench_fairness"
QUEUE = "default"
B_TIMEOUT_S = 300


def job_name(job_ms: int) -> str:
    return "tests.sleep" if job_ms > 0 else "scheduling.noop"


def ref(job_ms: int, name: str) -> str:
    return f"{job_ms}/{name}"


def setup_accounts(args) -> tuple[int, int, int]:
    """A, B and C: C is A's twin (same cap and budget) for the work-conservation phase, so that A's
    ledger and TaskRuns are its flood's alone."""
    from budgets.models import Account, Budget, Plan

    ids = []
    for slug, cap, cpu in (("bench-a", args.a_cap, args.a_cpu_seconds), ("bench-b", args.b_cap, args.b_cpu_seconds),
                           ("bench-c", args.a_cap, args.a_cpu_seconds)):
        account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug, "plan": Plan.STANDARD})
        Budget.objects.update_or_create(account=account, queue=QUEUE,
                                        defaults={"cpu_seconds_per_day": cpu, "max_concurrent": cap})
        ids.append(account.pk)
    return ids[0], ids[1], ids[2]


# --- The flood (a child process) -----------------------------------------------------------------

def child_flood(n: int, account_id: int, job_ms: int, chunk: int) -> None:
    """Enqueue A's flood as fast as one process can; report progress and a summary on stdout."""
    h.setup_django()
    from scheduling.runtime import enqueue, enqueue_many

    job = job_name(job_ms)
    held = 0
    t0 = time.perf_counter()
    for first in range(0, n, chunk):
        refs = [ref(job_ms, f"a-{i}") for i in range(first, min(n, first + chunk))]
        if chunk == 1:
            sent = [enqueue(job=job, account=account_id, ref=refs[0])]
        else:
            sent = enqueue_many(job=job, work=[(account_id, r) for r in refs])
        held += sent.count(None)
        print(f"progress {first + len(refs)}", flush=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"enqueued": n, "held_at_enqueue": held, "sent": n - held, "seconds": seconds,
                      "chunk": chunk, "ms_per_job": seconds * 1000 / n}), flush=True)


class CpuHog:
    """N busy processes beside the cluster for the whole benchmark (a loaded machine)."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
        h.at_exit(self.stop)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)


class Flood:
    def __init__(self, n: int, account_id: int, job_ms: int, chunk: int):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child-flood", str(n),
             "--child-account", str(account_id), "--job-ms", str(job_ms), "--flood-chunk", str(chunk)],
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


def most_at_once(intervals: list[tuple]) -> int:
    """The most of these (start, end) intervals that overlap at any moment (an end before a start
    at the same instant)."""
    at_once = peak = 0
    for _, step in sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals]):
        at_once += step
        peak = max(peak, at_once)
    return peak


def run_conservation(args, a_id: int, b_id: int, cluster: h.Cluster) -> dict:
    """A's backlog alone (run by its twin C, `a_id` here): how close its throughput comes to
    cap x 1000 / job ms."""
    from scheduling.models import TaskRun
    from scheduling.runtime import enqueue_many

    job = job_name(args.job_ms)
    refs = [ref(args.job_ms, f"a-conserve-{i}") for i in range(args.conserve_jobs)]
    with Sampler(a_id, b_id, interval=0.02) as sampler:
        t0 = time.perf_counter()
        sent = enqueue_many(job=job, work=[(a_id, r) for r in refs])
        enqueue_s = time.perf_counter() - t0

        def done():
            return TaskRun.objects.filter(job=job, ref__in=refs, outcome="succeeded").count() == len(refs)

        h.wait_until(done, timeout=B_TIMEOUT_S, interval=0.1, what="A's backlog", cluster=cluster)
    intervals = list(TaskRun.objects.filter(job=job, ref__in=refs, outcome="succeeded")
                     .values_list("started_at", "finished_at"))
    span_s = (max(f for _, f in intervals) - min(s for s, _ in intervals)).total_seconds()
    rate = len(refs) / span_s
    bound = args.a_cap * 1000 / args.job_ms if args.job_ms else None
    return {
        "jobs": len(refs), "sent_at_enqueue": len(refs) - sent.count(None),
        "enqueue_many_ms_per_job": enqueue_s * 1000 / len(refs), "span_s": span_s, "jobs_per_s": rate,
        "bound_jobs_per_s": bound, "fraction_of_bound": rate / bound if bound else None,
        "most_at_once_recorded": most_at_once(intervals), "cap": args.a_cap,
        "most_at_once_sampled": sampler.summary().get("a_active_reservations_max"),
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
    p.add_argument("--poll", type=float, default=None,
                   help="FAIRSHARE_POLL of the cluster (seconds; default: the product's default)")
    p.add_argument("--conserve-jobs", type=int, help="A's backlog in the work-conservation phase (400; 150 --quick)")
    p.add_argument("--flood-chunk", type=int, default=100, help="A's flood: jobs per enqueue_many call (1: enqueue)")
    p.add_argument("--cpu-hog", type=int, default=0, metavar="N", help="keep N busy processes running meanwhile")
    p.add_argument("--no-drain", action="store_true", help="do not wait for A's flood to finish")
    p.add_argument("--drain-timeout", type=float, default=480,
                   help="seconds after the flood starts to stop waiting for it to finish and report A as it "
                        "is (default 480)")
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--drop", action="store_true")
    p.add_argument("--strict", action="store_true", help="exit 1 when the goal is missed")
    p.add_argument("--json", type=Path, help="results file (default bench/results/fairness[-quick].json)")
    tiers.add_arguments(p)
    p.add_argument("--child-flood", type=int, help=argparse.SUPPRESS)
    p.add_argument("--child-account", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.flood = args.flood or (300 if args.quick else 2000)
    args.conserve_jobs = args.conserve_jobs or (150 if args.quick else 400)
    args.json = args.json or h.RESULTS_DIR / ("fairness-quick.json" if args.quick else "fairness.json")
    tiers.finish_arguments(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_flood:
        child_flood(args.child_flood, args.child_account, args.job_ms, args.flood_chunk)
        return 0
    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop)
    from budgets.models import UsageDay
    from scheduling.models import TaskRun

    log = h.log
    info = h.machine_info(db_url)
    a_id, b_id, c_id = setup_accounts(args)
    h.reset_tables(*h.RUN_TABLES)
    log(f"database {h.redact_url(db_url)}; A floods {args.flood} x {job_name(args.job_ms)} "
        f"({args.job_ms} ms); B sends {args.b_jobs} every {args.b_spacing_ms:.0f} ms")

    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-")
    h.at_exit(tmp.cleanup)
    env = h.cluster_env(workers=args.workers, poll=args.poll, FAIRSHARE_EXPORTS_ROOT=str(Path(tmp.name) / "exports"))
    from config import env as config_env

    args.poll_effective = args.poll if args.poll is not None else config_env.POLL.default
    log(f"starting qcluster ({args.workers} workers, poll {args.poll_effective}s)")
    if args.cpu_hog:
        log(f"starting {args.cpu_hog} busy process(es)")
        CpuHog(args.cpu_hog)
    cluster = h.start_cluster(env, Path(tmp.name) / "qcluster.log")
    results = {
        "benchmark": "fairness", "timestamp": h.utc_timestamp(),
        "parameters": {
            "flood": args.flood, "b_jobs": args.b_jobs, "b_spacing_ms": args.b_spacing_ms,
            "job": job_name(args.job_ms), "job_ms": args.job_ms, "a_max_concurrent": args.a_cap,
            "b_max_concurrent": args.b_cap, "a_cpu_seconds_per_day": args.a_cpu_seconds,
            "b_cpu_seconds_per_day": args.b_cpu_seconds, "workers": args.workers, "poll_s": args.poll_effective,
            "poll_is_default": args.poll is None, "cpu_hogs": args.cpu_hog, "flood_chunk": args.flood_chunk,
            "conserve_jobs": args.conserve_jobs,
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
        conserve = run_conservation(args, c_id, b_id, cluster)
        log(f"work conservation: A {conserve['jobs_per_s']:.1f} jobs/s of a bound {conserve['bound_jobs_per_s']} "
            f"(cap {args.a_cap}, {args.job_ms} ms jobs); at once at most {conserve['most_at_once_recorded']}")
        h.wait_until(h.broker_empty, timeout=60, what="broker empty after the conservation phase", cluster=cluster)
        time.sleep(1)

        with Sampler(a_id, b_id) as flood_sampler:
            t_flood = time.perf_counter()
            flood = Flood(args.flood, a_id, args.job_ms, args.flood_chunk)
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
    tier_results = tiers.run_tiers(args)

    ratio = during["wait_ms"]["p95"] / solo["wait_ms"]["p95"]
    fraction = conserve["fraction_of_bound"] or 0
    results.update({
        "solo": solo, "flood": during, "a": a, "conservation": conserve,
        "b_usage": dict(UsageDay.objects.filter(account_id=b_id, queue=QUEUE).values("cpu_used_ms", "runs", "deferrals").first() or {}),
        "goals": {"fairness": {"goal": f"B's p95 wait during A's flood <= {GOAL_FACTOR:g}x its solo p95",
                               "value": ratio, "pass": ratio <= GOAL_FACTOR},
                  "solo_p95": {"goal": f"B's solo p95 wait <= {SOLO_P95_GOAL_MS} ms",
                               "value": solo["wait_ms"]["p95"], "pass": solo["wait_ms"]["p95"] <= SOLO_P95_GOAL_MS},
                  "conservation": {"goal": f"A's backlog at >= {CONSERVATION_GOAL:g} of cap x 1000 / job ms, "
                                           "never more than its cap at once",
                                   "value": fraction, "pass": fraction >= CONSERVATION_GOAL
                                   and conserve["most_at_once_recorded"] <= args.a_cap},
                  **{f"tiers_{name}": {"goal": t["goal"], "pass": t["pass"]} for name, t in tier_results.items()}},
        "tiers": tier_results,
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
        ["backlog alone (work conservation)",
         f"{conserve['jobs']} jobs at {conserve['jobs_per_s']:.1f} jobs/s = {fraction:.2f} of the bound "
         f"{conserve['bound_jobs_per_s']} (cap {args.a_cap} x 1000 / {args.job_ms} ms); at once at most "
         f"{conserve['most_at_once_recorded']} recorded, {conserve['most_at_once_sampled']} sampled"],
        ["backlog enqueue_many", f"{conserve['enqueue_many_ms_per_job']:.2f} ms per job"],
        ["flood enqueued", f"{args.flood} in {a['enqueue']['seconds']:.1f}s "
                           f"({a['enqueue']['ms_per_job']:.2f} ms per job, chunks of {args.flood_chunk}): "
                           f"{a['enqueue']['sent']} to the broker, {a['enqueue']['held_at_enqueue']} held at enqueue"],
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
    goals = results["goals"]
    print(f"poll {args.poll_effective}s ({'default' if args.poll is None else '--poll'}), "
          f"{args.cpu_hog} busy process(es)")
    print(f"{'PASS' if goals['fairness']['pass'] else 'MISS'}  {goals['fairness']['goal']}: "
          f"{during['wait_ms']['p95']:.0f} ms vs {solo['wait_ms']['p95']:.0f} ms solo = {ratio:.2f}x")
    print(f"{'PASS' if goals['solo_p95']['pass'] else 'MISS'}  {goals['solo_p95']['goal']}: "
          f"{solo['wait_ms']['p95']:.0f} ms")
    print(f"{'PASS' if goals['conservation']['pass'] else 'MISS'}  {goals['conservation']['goal']}: "
          f"{fraction:.2f}, at most {conserve['most_at_once_recorded']} at once")
    if tier_results:
        print()
        tiers.print_tiers(tier_results)
    h.print_load(results)
    h.write_results(args.json, results)
    return 1 if args.strict and not all(g["pass"] for g in goals.values()) else 0


if __name__ == "__main__":
    h.run(main)
