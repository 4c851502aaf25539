#!/usr/bin/env python
"""Tiered fair share with real workers: weights, a rate limit, priorities (bench/fairness.py runs
these after its flood; this file runs them alone).

    .venv/bin/python bench/tiers.py                  # all three, full length
    .venv/bin/python bench/tiers.py --quick          # shorter
    .venv/bin/python bench/tiers.py --tiers rate     # one of them

Each scenario starts its own `manage.py qcluster` (the ORM broker, the benchmark's database) and
runs `tests.sleep` jobs of 20 ms:
- weights: accounts of weight 1 and 3, caps above the worker count (8), both with a backlog deeper
  than the run; 4 workers, --weights-s seconds (60; 15 --quick) measured after a 3 s start: each
  account's share of worker time (the recorded runs' wall time inside the window). Goal: 1 : 3
  within 10% (heavy / light between 2.7 and 3.3).
- rate: an account limited to 10 starts per second with a backlog of 500, beside another
  account's backlog deeper than the run; 4 workers. Goals: never more than 10 of its starts in any
  1-second window (recorded starts, every window), at least 9 starts/s over its backlog, and the
  workers kept busy: jobs/s of both accounts over its backlog's span >= 0.95 of the other account's
  alone, measured first on the same workers (work conservation; issue 43).
- priority: one account (cap 2, 2 workers) with 1,000 low-priority jobs held, then 20 of priority
  50: goal, all 20 start before the next 20 low-priority ones.
"""
from __future__ import annotations

import argparse
import bisect
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_tiers"
QUEUE = "default"
JOB, JOB_MS = "tests.sleep", 20
SCENARIOS = ("weights", "rate", "priority")
WEIGHT_RATIO_GOAL, WEIGHT_TOLERANCE = 3.0, 0.10
RATE, RATE_GOAL, CONSERVATION_GOAL = 10, 9.0, 0.95
PRIORITY_JOBS = 20
BASELINE_S = 10  # the rate scenario's other account alone, first


def account(slug: str, *, cap: int, weight: int = 1, rate: int | None = None) -> int:
    from budgets.models import Account, Budget, Plan

    acc, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug, "plan": Plan.STANDARD})
    Budget.objects.update_or_create(account=acc, queue=QUEUE, defaults={
        "cpu_seconds_per_day": 36_000, "max_concurrent": cap, "weight": weight, "rate_starts": rate,
        "rate_period_s": 1})
    return acc.pk


def backlog(account_id: int, n: int, name: str, priority: int | None = None) -> None:
    from scheduling.runtime import enqueue_many

    for first in range(0, n, 500):
        enqueue_many(job=JOB, work=[(account_id, f"{JOB_MS}/{name}-{i}") for i in range(first, min(n, first + 500))],
                     priority=priority)


def cluster(workers: int, tmp: str, name: str) -> h.Cluster:
    env = h.cluster_env(workers=workers, poll=None, FAIRSHARE_EXPORTS_ROOT=str(Path(tmp) / "exports"))
    return h.start_cluster(env, Path(tmp) / f"qcluster-{name}.log")


def runs(account_id: int) -> list[tuple[dt.datetime, dt.datetime]]:
    from scheduling.models import TaskRun

    return list(TaskRun.objects.filter(account_id=account_id, outcome="succeeded", finished_at__isnull=False)
                .values_list("started_at", "finished_at"))


def busy_s(intervals, start: dt.datetime, end: dt.datetime) -> float:
    """Worker time of these runs inside [start, end]."""
    return sum(max(0.0, (min(f, end) - max(s, start)).total_seconds()) for s, f in intervals)


def most_in_window(times: list[dt.datetime], seconds: float) -> int:
    times = sorted(times)
    window = dt.timedelta(seconds=seconds)
    return max((bisect.bisect_left(times, t + window) - i for i, t in enumerate(times)), default=0)


def weights(args, tmp: str) -> dict:
    workers, measure_s = 4, args.weights_s
    depth = int((measure_s + 10) * workers * 1000 / JOB_MS)  # deeper than the run, for either account
    light, heavy = account("tier-light", cap=8, weight=1), account("tier-heavy", cap=8, weight=3)
    backlog(light, depth, "light")
    backlog(heavy, depth, "heavy")
    c = cluster(workers, tmp, "weights")
    try:
        from django.utils import timezone

        time.sleep(3)  # the start: forks, what enqueue sent straight to the broker
        start = timezone.now()
        time.sleep(measure_s)
        end = timezone.now()
    finally:
        c.stop()
    light_s, heavy_s = busy_s(runs(light), start, end), busy_s(runs(heavy), start, end)
    ratio = heavy_s / light_s if light_s else float("inf")
    return {"workers": workers, "seconds": measure_s, "light_worker_s": light_s, "heavy_worker_s": heavy_s,
            "heavy_share": heavy_s / (light_s + heavy_s) if light_s + heavy_s else None, "ratio": ratio,
            "goal": f"heavy / light worker time {WEIGHT_RATIO_GOAL:g} within {WEIGHT_TOLERANCE:.0%}",
            "pass": abs(ratio / WEIGHT_RATIO_GOAL - 1) <= WEIGHT_TOLERANCE}


def rate(args, tmp: str) -> dict:
    """The other account's backlog runs alone first (`BASELINE_S`): what these workers do with no
    limit in the way; then the limited account's backlog joins it. Work conservation: jobs/s of
    both over the limited backlog's span against that baseline."""
    from django.utils import timezone

    from scheduling.models import TaskRun

    workers, jobs = 4, args.rate_jobs
    limited = account("tier-limited", cap=8, rate=RATE)
    other = account("tier-other", cap=8)
    backlog(other, int((jobs / RATE + BASELINE_S + 20) * workers * 1000 / JOB_MS), "other")
    c = cluster(workers, tmp, "rate")
    try:
        time.sleep(3)  # the start
        base_from = timezone.now()
        time.sleep(BASELINE_S)
        base_to = timezone.now()
        backlog(limited, jobs, "limited")
        h.wait_until(lambda: TaskRun.objects.filter(account_id=limited, outcome="succeeded").count() >= jobs,
                     timeout=jobs / RATE * 3 + 60, interval=0.25, what="the rate-limited backlog", cluster=c)
    finally:
        c.stop()
    limited_runs, other_runs = runs(limited), runs(other)
    starts = sorted(s for s, _ in limited_runs)
    span_start, span_end = starts[0], max(f for _, f in limited_runs)
    span_s = (span_end - span_start).total_seconds()
    per_s = (len(starts) - 1) / (starts[-1] - starts[0]).total_seconds()
    base_per_s = sum(base_from <= f <= base_to for _, f in other_runs) / (base_to - base_from).total_seconds()
    both_per_s = sum(span_start <= f <= span_end for _, f in limited_runs + other_runs) / span_s
    conservation = both_per_s / base_per_s
    most = most_in_window(starts, 1.0)
    return {"workers": workers, "jobs": jobs, "limit_per_s": RATE, "most_in_any_1s": most, "starts_per_s": per_s,
            "baseline_jobs_per_s": base_per_s, "jobs_per_s_with_the_limited": both_per_s,
            "conservation": conservation, "worker_busy_fraction": busy_s(limited_runs + other_runs, span_start, span_end)
            / (workers * span_s),
            "goal": f"<= {RATE} starts in any 1 s, >= {RATE_GOAL:g}/s, jobs/s >= {CONSERVATION_GOAL:g} of the "
                    "workers' own without the limited account",
            "pass": most <= RATE and per_s >= RATE_GOAL and conservation >= CONSERVATION_GOAL}


def priority(args, tmp: str) -> dict:
    from django.utils import timezone

    from scheduling.models import TaskRun
    from scheduling.runtime import enqueue

    owner = account("tier-priority", cap=2)
    backlog(owner, args.priority_low, "low", priority=0)
    c = cluster(2, tmp, "priority")
    try:
        time.sleep(2)  # its line works off
        urgent_at = timezone.now()
        for i in range(PRIORITY_JOBS):
            enqueue(job=JOB, account=owner, ref=f"{JOB_MS}/high-{i}", priority=50)
        h.wait_until(lambda: TaskRun.objects.filter(account_id=owner, ref__startswith=f"{JOB_MS}/high-",
                                                    outcome="succeeded").count() >= PRIORITY_JOBS,
                     timeout=60, interval=0.1, what="the high-priority jobs", cluster=c)
    finally:
        c.stop()
    started = TaskRun.objects.filter(account_id=owner, outcome="succeeded")
    last_high = max(started.filter(ref__startswith=f"{JOB_MS}/high-").values_list("started_at", flat=True))
    low_between = started.filter(ref__startswith=f"{JOB_MS}/low-", started_at__gt=urgent_at,
                                 started_at__lt=last_high).count()
    return {"low_jobs": args.priority_low, "high_jobs": PRIORITY_JOBS,
            "low_started_after_the_high_were_sent_before_the_last_high": low_between,
            "high_done_s": (last_high - urgent_at).total_seconds(),
            "goal": f"all {PRIORITY_JOBS} high start before the next {PRIORITY_JOBS} low",
            "pass": low_between < PRIORITY_JOBS}


RUNNERS = {"weights": weights, "rate": rate, "priority": priority}


def run_tiers(args) -> dict:
    """The scenarios `args.tiers` names, each in clean tables; returns their results."""
    results = {}
    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-tiers-")
    h.at_exit(tmp.cleanup)
    for name in args.tiers:
        h.reset_tables(*h.RUN_TABLES)
        h.log(f"tiers: {name}")
        results[name] = RUNNERS[name](args, tmp.name)
        h.log(f"tiers: {name}: {'PASS' if results[name]['pass'] else 'MISS'}")
    return results


def print_tiers(results: dict) -> None:
    rows = []
    if "weights" in results:
        w = results["weights"]
        rows.append(["weights 1 : 3", f"worker time light {w['light_worker_s']:.1f} s, heavy {w['heavy_worker_s']:.1f} s "
                     f"over {w['seconds']} s: heavy / light {w['ratio']:.2f} (share {w['heavy_share']:.3f})",
                     "PASS" if w["pass"] else "MISS"])
    if "rate" in results:
        r = results["rate"]
        rows.append([f"rate {r['limit_per_s']}/s", f"most in any 1 s {r['most_in_any_1s']}, {r['starts_per_s']:.2f} starts/s, "
                     f"{r['jobs_per_s_with_the_limited']:.0f} jobs/s against {r['baseline_jobs_per_s']:.0f} without it: "
                     f"conservation {r['conservation']:.2f}",
                     "PASS" if r["pass"] else "MISS"])
    if "priority" in results:
        p = results["priority"]
        rows.append(["priority", f"{p['low_started_after_the_high_were_sent_before_the_last_high']} low started "
                     f"before the last of {p['high_jobs']} high ({p['high_done_s']:.2f} s)", "PASS" if p["pass"] else "MISS"])
    print(h.render_table(["scenario", "measured", "goal"], rows, right=set()))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiers", type=lambda v: [t for t in v.split(",") if t], default=list(SCENARIOS),
                   help=f"comma-separated scenarios of {', '.join(SCENARIOS)} (default all; '' for none)")
    p.add_argument("--weights-s", type=float, help="seconds the weights scenario measures (60; 15 --quick)")
    p.add_argument("--rate-jobs", type=int, help="the rate-limited backlog (500; 150 --quick)")
    p.add_argument("--priority-low", type=int, default=1000, help="low-priority jobs held before the high ones")


def finish_arguments(args) -> None:
    unknown = set(args.tiers) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown --tiers {', '.join(sorted(unknown))}")
    args.weights_s = args.weights_s or (15 if args.quick else 60)
    args.rate_jobs = args.rate_jobs or (150 if args.quick else 500)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter scenarios")
    add_arguments(p)
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--drop", action="store_true")
    p.add_argument("--json", type=Path, help="results file (default bench/results/tiers[-quick].json)")
    args = p.parse_args(argv)
    finish_arguments(args)
    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop)
    results = {"benchmark": "tiers", "timestamp": h.utc_timestamp(), "machine": h.machine_info(db_url),
               "parameters": {"quick": args.quick, "tiers": args.tiers, "job": JOB, "job_ms": JOB_MS}}
    results["tiers"] = run_tiers(args)
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    print()
    print_tiers(results["tiers"])
    h.print_load(results)
    h.write_results(args.json or h.RESULTS_DIR / ("tiers-quick.json" if args.quick else "tiers.json"), results)
    return 0


if __name__ == "__main__":
    h.run(main)
