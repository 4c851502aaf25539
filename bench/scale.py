#!/usr/bin/env python
"""Scale-out: one cluster per queue vs two, on the ORM broker and on Redis, in one run.

    .venv/bin/python bench/scale.py                 # 24 exports + 300 small jobs per round
    .venv/bin/python bench/scale.py --quick         # 8 exports + 100 small jobs (smoke run)

Four rounds (orm x 1 cluster, orm x 2, redis x 1, redis x 2). In each, N `qcluster` processes per
queue (exports: FAIRSHARE_EXPORT_WORKERS each; default: FAIRSHARE_WORKERS each) in the benchmark's
own database, then one backlog: `--exports` exports of three accounts (caps high enough not to
bind) interleaved with `--small-jobs` `scheduling.noop` jobs. Measured per round:

- exports/min: exports over (last completion - first request);
- small-job p50/p95 latency: enqueue -> the run's finish (TaskRun.finished_at);
- where the time went: host CPU busy % (/proc/stat over the round), the exports' CPU / DB-wait
  share (their TaskRuns), database backends active vs idle (pg_stat_activity sampled every 20 ms),
  and for Redis the broker's own CPU seconds (INFO cpu).

Then a verdict names the bottleneck from those figures, prints a table and writes JSON to
bench/results/scale[-quick].json. Two clusters on one machine share its cores: the comparison says
whether a second host would help (it does when the first cluster is not the limit).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_scale"
ACCOUNTS = ("scale-1", "scale-2", "scale-3")
RANGE = (dt.date(2026, 3, 1), dt.date(2026, 3, 31))
WORKER_ENV = {"FAIRSHARE_EXPORT_WORKERS": "2", "FAIRSHARE_RELEASE_POLL": "0.2", "FAIRSHARE_WORKER_HEARTBEAT": "1"}


def host_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def setup(rows: int) -> list:
    from django.contrib.auth import get_user_model

    from budgets.models import Account, Budget, Membership, Role
    from tests.exports.support import add_events

    h.reset_tables(*h.RUN_TABLES, "exports.ExportRecord", "exports.ActivityEvent")
    owners = []
    for slug in ACCOUNTS:
        account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug})
        for queue in ("exports", "default"):
            Budget.objects.update_or_create(account=account, queue=queue,
                                            defaults={"cpu_seconds_per_day": 1_000_000, "max_concurrent": 50})
        user, _ = get_user_model().objects.get_or_create(username=f"{slug}-owner")
        Membership.objects.get_or_create(account=account, user=user, defaults={"role": Role.OWNER})
        add_events(account, rows)
        owners.append((account, user))
    return owners


def use_broker(name: str, redis_url: str) -> dict[str, str]:
    from django_q.conf import Conf

    if name == "orm":
        Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = "scheduling.broker.FifoORM", "default", None
        return {}
    import redis

    redis.from_url(redis_url).flushdb()
    Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = None, None, redis_url
    return {"REDIS_URL": redis_url}


def redis_cpu_s(url: str) -> float:
    import redis

    info = redis.from_url(url).info("cpu")
    return info["used_cpu_sys"] + info["used_cpu_user"]


def run_round(args, broker: str, clusters: int, owners, work: Path) -> dict:
    from django.db.models import Max, Min, Sum

    from exports.models import ExportRecord, ExportStatus
    from exports.requests import export_request
    from scheduling.models import TaskRun
    from scheduling.runtime import enqueue

    h.reset_tables(*h.RUN_TABLES, "exports.ExportRecord")
    env = h.cluster_env(workers=args.workers, poll=0.1, **WORKER_ENV, **use_broker(broker, args.redis_url),
                        FAIRSHARE_EXPORTS_ROOT=str(work / f"{broker}-{clusters}"))
    since = dt.datetime.now(dt.UTC)
    pools = [h.start_cluster(env, work / f"{broker}-{clusters}-{q}-{i}.log", queue=q)
             for i in range(clusters) for q in ("exports", "default")]
    from scheduling import processes

    processes.wait_ready(pools, {"exports": 2 * clusters, "default": args.workers * clusters}, since=since)
    cpu0, redis0 = host_cpu(), redis_cpu_s(args.redis_url) if broker == "redis" else 0.0
    sent: dict[str, float] = {}
    every = max(1, args.small_jobs // max(1, args.exports))
    with h.WaitSampler(h.bench_database_url(args.db_name)) as sampler:
        for i in range(max(args.exports, args.small_jobs // every)):
            account, user = owners[i % len(owners)]
            if i < args.exports:
                export_request(account_slug=account.slug, user=user, start=RANGE[0], end=RANGE[1] - dt.timedelta(days=i % 20),
                               idempotency_key=f"scale-{broker}-{clusters}-{i}")
            for j in range(every):
                ref = f"small-{i}-{j}"
                sent[ref] = time.time()
                enqueue(job="scheduling.noop", account=account.pk, ref=ref)
        h.wait_until(lambda: ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED).count() == args.exports
                     and TaskRun.objects.filter(job="scheduling.noop", finished_at__isnull=False).count() >= len(sent),
                     timeout=args.timeout, interval=0.2, what="the backlog")
    cpu1 = host_cpu()
    broker_cpu = (redis_cpu_s(args.redis_url) - redis0) if broker == "redis" else None
    for pool in pools:
        pool.stop()
    span = ExportRecord.objects.aggregate(first=Min("created_at"), last=Max("completed_at"))
    minutes = (span["last"] - span["first"]).total_seconds() / 60
    latencies = [run.finished_at.timestamp() - sent[run.ref]
                 for run in TaskRun.objects.filter(job="scheduling.noop", ref__in=sent).exclude(finished_at=None)]
    figures = TaskRun.objects.filter(job="exports.build").aggregate(cpu=Sum("cpu_ms"), db=Sum("db_wait_ms"), wall=Sum("wall_ms"))
    backends = sampler.summary()["backend_seconds"]
    active = sum(v for k, v in backends.items() if k.startswith("active"))
    return {
        "broker": broker, "clusters": clusters, "exports": args.exports, "small_jobs": len(sent),
        "exports_per_min": round(args.exports / minutes, 1),
        "small_p50_s": round(h.median(latencies), 3), "small_p95_s": round(h.percentile(latencies, 95), 3),
        "host_cpu_busy": round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3),
        "export_cpu_share": round((figures["cpu"] or 0) / max(1, figures["wall"] or 1), 3),
        "export_db_wait_share": round((figures["db"] or 0) / max(1, figures["wall"] or 1), 3),
        "db_active_backend_s": round(active, 2), "db_idle_in_tx_backend_s": backends.get("idle in transaction", 0),
        "round_s": round(minutes * 60, 1), "broker_cpu_s": None if broker_cpu is None else round(broker_cpu, 2),
    }


def verdict(rounds: list[dict]) -> str:
    """Name the bottleneck from the measurements (not from expectations)."""
    def best(broker):
        return {r["clusters"]: r for r in rounds if r["broker"] == broker}

    lines = []
    for broker in ("orm", "redis"):
        one, two = best(broker)[1], best(broker)[2]
        gain = two["exports_per_min"] / one["exports_per_min"] - 1
        lines.append(f"{broker}: two clusters {gain:+.0%} exports/min, small-job p95 {one['small_p95_s']} -> "
                     f"{two['small_p95_s']} s; host CPU busy {one['host_cpu_busy']:.0%} -> {two['host_cpu_busy']:.0%}")
    top = max(rounds, key=lambda r: r["host_cpu_busy"])
    db_share = max(r["export_db_wait_share"] for r in rounds)
    if top["host_cpu_busy"] >= 0.85:
        lines.append(f"bottleneck: host CPU (busy {top['host_cpu_busy']:.0%} at {top['broker']} x {top['clusters']}): "
                     "a second cluster on the same cores only shares them; a second host would add capacity")
        if db_share >= 0.5:
            lines.append(f"  ...much of it PostgreSQL's: exports wait on the database up to {db_share:.0%} of their "
                         "time and it runs on these cores; give the database its own host first")
    elif db_share >= 0.5:
        lines.append("bottleneck: the database (exports spend most of their time waiting on it)")
    else:
        lines.append("bottleneck: neither CPU nor database saturated: the broker/poll cadence and the per-task overhead")
    lines.append(f"(host CPU counts every process on this machine; load average {os.getloadavg()[0]:.1f} now)")
    redis_cpu = [r["broker_cpu_s"] for r in rounds if r["broker_cpu_s"] is not None]
    if redis_cpu:
        lines.append(f"Redis itself used {max(redis_cpu)} CPU s at most per round: not the limit")
    return "\n".join(lines)


def report(results: dict) -> None:
    cols = ["broker", "clusters", "exports_per_min", "small_p50_s", "small_p95_s", "host_cpu_busy",
            "export_cpu_share", "export_db_wait_share", "db_active_backend_s", "broker_cpu_s", "round_s"]
    rows = [[r[c] if isinstance(r[c], str) else h.fmt(r[c], "g") for c in cols] for r in results["rounds"]]
    print(h.render_table(cols, rows, right=set(range(1, len(cols)))))
    print(results["verdict"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="8 exports and 100 small jobs per round")
    p.add_argument("--exports", type=int, help="exports per round (default 24; 8 with --quick)")
    p.add_argument("--small-jobs", type=int, help="small jobs per round (default 300; 100 with --quick)")
    p.add_argument("--rows", type=int, default=20000, help="activity rows per account (each export reads up to all)")
    p.add_argument("--workers", type=int, default=2, help="default-queue workers per cluster")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9"))
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    p.add_argument("--json", type=Path, help="results file (default bench/results/scale[-quick].json)")
    args = p.parse_args()
    args.exports = args.exports or (8 if args.quick else 24)
    args.small_jobs = args.small_jobs or (100 if args.quick else 300)
    db_url = h.prepare(args.db_name, fresh=False, drop=args.drop)
    owners = setup(args.rows)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="fairshare-scale-") as work:
        for broker in ("orm", "redis"):
            for clusters in (1, 2):
                h.log(f"round: {broker} broker, {clusters} cluster(s) per queue")
                rounds.append(run_round(args, broker, clusters, owners, Path(work)))
    results = {"rounds": rounds, "verdict": verdict(rounds), "machine": h.machine_info(db_url),
               "finished_at": h.utc_timestamp()}
    report(results)
    h.write_results(args.json or h.RESULTS_DIR / f"scale{'-quick' if args.quick else ''}.json", results)
    return 0


if __name__ == "__main__":
    h.run(main)
