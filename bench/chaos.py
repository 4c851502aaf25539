#!/usr/bin/env python
"""Randomized kill loop: do exports survive random SIGKILLs, pool kills, restarts and dropped
database connections? (SPEC §4: no duplicate or lost results, whatever crashes.)

    .venv/bin/python bench/chaos.py                       # 36 exports, 3 minutes of chaos, ORM broker
    .venv/bin/python bench/chaos.py --broker redis        # the same on the Redis broker (REDIS_URL or local)
    .venv/bin/python bench/chaos.py --quick               # 12 exports, 60 s

Two real `qcluster` pools of the exports queue (two workers each) in the benchmark's own database;
three accounts (one export at a time, two, and four) with their activity rows. Exports are
requested through the whole chaos phase. Every 1-4 s one random blow:

- `kill_worker`: SIGKILL one worker process of a pool (it may hold the pool's queue lock: the
  pool can stall, see below);
- `kill_pool`: SIGKILL a whole pool (its session), then start it again;
- `stop_pool`: SIGTERM to a pool's main PID (graceful), SIGKILL after 10 s, start it again;
- `drop_connections`: `pg_terminate_backend` of every worker database connection.

This process plays the schedules and the supervisor: every half second it runs reclaim_expired,
task_runs_sweep_lost and reconcile_exports, and restarts a pool whose queue /healthz would call stalled. After the chaos
it waits for every export to finish, then checks what a user would check and prints a table:
every export succeeded, once (one object and one manifest under its key, bytes matching its
checksum), one "export ready" notice each, the usage ledger equal to the CPU recorded by the
runs that held a slot, and nothing left reserved. Exit 1 if any check fails.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_chaos"
ACCOUNTS = (("chaos-1", 1), ("chaos-2", 2), ("chaos-4", 4))  # slug, exports max_concurrent
RANGE = (dt.date(2026, 3, 1), dt.date(2026, 3, 31))
BLOWS = ("kill_worker", "kill_pool", "stop_pool", "drop_connections")
# Fast recovery, as in the crash tests: leases of seconds, small batches, a fast pulse.
WORKER_ENV = {
    "FAIRSHARE_EXPORT_WORKERS": "2", "FAIRSHARE_EXPORT_BATCH_ROWS": "200", "FAIRSHARE_EXPORT_LEASE": "3",
    "FAIRSHARE_RESERVATION_LEASE": "3", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5", "FAIRSHARE_RELEASE_POLL": "0.2",
    "FAIRSHARE_WORKER_HEARTBEAT": "1", "FAIRSHARE_EXPORT_RETRY": "60", "FAIRSHARE_EXPORT_TIMEOUT": "50",
    "FAIRSHARE_EXPORT_ATTEMPT_DEADLINE": "40",
}
# This process: the reconciler re-sends after 5 s, and a queue is called stalled after 10 s. Its
# health readings expect the workers' 1-second heartbeat (else system check scheduling.E003 stops
# its `migrate`: a 5-second max age under the default 10-second heartbeat).
DRIVER_ENV = {"FAIRSHARE_EXPORT_STALE_AFTER": "5", "FAIRSHARE_QUEUE_STALL_AFTER_S": "10",
              "FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE": "5", "FAIRSHARE_WORKER_HEARTBEAT": "1"}


class Pools:
    def __init__(self, env: dict[str, str], logs: Path, count: int):
        self.env, self.logs, self.started = env, logs, 0
        self.stall_restart_at = 0.0
        self.pools = [self._start() for _ in range(count)]

    def _start(self):
        self.started += 1
        return h.start_cluster(self.env, self.logs / f"pool-{self.started}.log", queue="exports")

    def restart(self, index: int, *, graceful: bool) -> None:
        pool = self.pools[index]
        if graceful:
            pool.stop(timeout=10)
        else:
            os.killpg(pool.pid, signal.SIGKILL)
            pool.stop(timeout=0)
        self.pools[index] = self._start()

    def worker_pids(self, index: int) -> list[int]:
        from scheduling.models import WorkerHeartbeat

        pids = [int(w.rsplit(":", 1)[1]) for w in WorkerHeartbeat.objects.values_list("worker", flat=True)]
        return [pid for pid in pids if _session_of(pid) == self.pools[index].pid]


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except ProcessLookupError:
        return None


def setup(args, mail_dir: Path) -> list:
    from django.contrib.auth import get_user_model

    from budgets.models import Account, Budget, Membership, Role
    from tests.exports.support import add_events

    h.reset_tables(*h.RUN_TABLES, "exports.ExportRecord", "exports.ActivityEvent")
    owners = []
    for slug, cap in ACCOUNTS:
        account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug})
        Budget.objects.update_or_create(account=account, queue="exports",
                                        defaults={"cpu_seconds_per_day": 100_000, "max_concurrent": cap})
        user, _ = get_user_model().objects.get_or_create(username=f"{slug}-owner", defaults={"email": f"{slug}@example.com"})
        Membership.objects.get_or_create(account=account, user=user, defaults={"role": Role.OWNER})
        add_events(account, args.rows)
        owners.append((account, user))
    return owners


def blow(kind: str, pools: Pools, rng: random.Random, counts: dict) -> None:
    from django.db import connection

    index = rng.randrange(len(pools.pools))
    if kind == "kill_worker":
        pids = pools.worker_pids(index)
        if not pids:
            return
        os.kill(rng.choice(pids), signal.SIGKILL)
    elif kind in ("kill_pool", "stop_pool"):
        pools.restart(index, graceful=kind == "stop_pool")
    else:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                           "AND backend_type = 'client backend'")
            counts["connections_dropped"] += cursor.fetchone()[0]
    counts[kind] += 1


def maintain(pools: Pools, counts: dict) -> None:
    """What the schedules and the supervisor do: reclaim, reconcile, restart a stalled pool."""
    from budgets.services import reclaim_expired
    from exports.maintenance import reconcile_exports
    from scheduling.liveness import queue_health
    from scheduling.runtime import close_old_connections
    from scheduling.services import task_runs_sweep_lost

    close_old_connections()
    try:
        reclaim_expired()
        task_runs_sweep_lost()
        counts["reconciled"] += reconcile_exports()
        # Like a supervisor's start period: a pool just restarted is given time to start working.
        settled = time.monotonic() - pools.stall_restart_at > float(DRIVER_ENV["FAIRSHARE_QUEUE_STALL_AFTER_S"])
        if settled and any(q.stalled for q in queue_health() if q.queue == "exports"):
            h.log("the exports queue is stalled: restarting its pools")
            counts["stall_restarts"] += 1
            pools.stall_restart_at = time.monotonic()
            for index in range(len(pools.pools)):
                pools.restart(index, graceful=False)
    except Exception as exc:  # our own connection may have been among the dropped ones
        h.log(f"maintenance pass failed ({type(exc).__name__}); next pass")
        close_old_connections()


def check(records, root: Path, mail_dir: Path) -> dict:
    from django.db.models import Sum

    from budgets.models import Reservation, ReservationStatus, UsageDay
    from exports.models import ExportStatus
    from exports.requests import BUILD_JOB
    from scheduling.models import Outcome, TaskRun

    mail = b"".join(p.read_bytes() for p in mail_dir.iterdir() if p.is_file())
    result = {"exports": len(records), "succeeded": 0, "one_object_each": 0, "bytes_match": 0, "one_notice_each": 0}
    for record in records:
        record.refresh_from_db()
        key = f"exports/{record.account_id}/{record.pk}.csv"
        files = sorted(p.name for p in (root / "exports" / str(record.account_id)).glob(f"{record.pk}*"))
        result["succeeded"] += record.status == ExportStatus.SUCCEEDED
        result["one_object_each"] += files == [f"{record.pk}.csv", f"{record.pk}.csv.manifest.json"]
        body = (root / key).read_bytes() if (root / key).exists() else b""
        result["bytes_match"] += hashlib.sha256(body).hexdigest() == record.checksum_sha256 and len(body) == record.byte_size
        result["one_notice_each"] += mail.count(f"Export {record.pk} (".encode()) == 1
    # Runs that held a slot and were settled or reclaimed (a run killed before admission was not).
    admitted = TaskRun.objects.filter(job=BUILD_JOB).exclude(outcome__in=[Outcome.DEFERRED, Outcome.REJECTED]) \
        .exclude(outcome=Outcome.RUNNING, finished_at__isnull=True)
    result["ledger_cpu_ms"] = UsageDay.objects.filter(queue="exports").aggregate(s=Sum("cpu_used_ms"))["s"] or 0
    result["recorded_cpu_ms"] = admitted.aggregate(s=Sum("cpu_ms"))["s"] or 0
    result["reserved_ms_left"] = UsageDay.objects.aggregate(s=Sum("cpu_reserved_ms"))["s"] or 0
    result["slots_left"] = Reservation.objects.filter(
        status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).count()
    result["runs_by_outcome"] = dict(sorted(
        (o, TaskRun.objects.filter(job=BUILD_JOB, outcome=o).count()) for o in Outcome.values
        if TaskRun.objects.filter(job=BUILD_JOB, outcome=o).exists()))
    n = len(records)
    result["ok"] = (result["succeeded"] == result["one_object_each"] == result["bytes_match"]
                    == result["one_notice_each"] == n and result["ledger_cpu_ms"] == result["recorded_cpu_ms"]
                    and result["reserved_ms_left"] == 0 and result["slots_left"] == 0)
    return result


def use_redis(url: str) -> None:
    import redis
    from django_q.conf import Conf

    redis.from_url(url).flushdb()
    Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = None, None, url


def run_chaos(args, work: Path) -> dict:
    from exports.requests import export_request

    mail_dir, root, logs = work / "mail", work / "exports-root", work / "logs"
    for path in (mail_dir, root, logs):
        path.mkdir()
    owners = setup(args, mail_dir)
    env = h.cluster_env(workers=2, poll=0.2, **WORKER_ENV, FAIRSHARE_EXPORTS_ROOT=str(root),
                        EMAIL_BACKEND="django.core.mail.backends.filebased.EmailBackend", EMAIL_FILE_PATH=str(mail_dir))
    if args.broker == "redis":
        env["REDIS_URL"] = args.redis_url
    from django.conf import settings

    settings.STORAGES["exports"]["OPTIONS"]["location"] = str(root)
    settings.EMAIL_BACKEND, settings.EMAIL_FILE_PATH = env["EMAIL_BACKEND"], str(mail_dir)
    rng = random.Random(args.seed)
    counts = dict.fromkeys((*BLOWS, "connections_dropped", "reconciled", "stall_restarts"), 0)
    pools = Pools(env, logs, args.pools)
    records, started = [], time.monotonic()
    next_blow, next_export = started + 5, started
    spacing = args.duration * 0.8 / args.exports
    while time.monotonic() - started < args.duration:
        now = time.monotonic()
        if len(records) < args.exports and now >= next_export:
            account, user = owners[len(records) % len(owners)]
            try:
                records.append(export_request(account_slug=account.slug, user=user, start=RANGE[0], end=RANGE[1],
                                              idempotency_key=f"chaos-{len(records)}")[0])
            except Exception as exc:
                h.log(f"request failed ({type(exc).__name__}), trying again")
            next_export = now + spacing
        if now >= next_blow:
            kind = rng.choice(BLOWS)
            h.log(f"blow: {kind}")
            blow(kind, pools, rng, counts)
            next_blow = now + rng.uniform(1, 4)
        maintain(pools, counts)
        time.sleep(0.5)
    h.log("chaos over; waiting for every export to finish")
    deadline = time.monotonic() + args.drain_timeout
    while time.monotonic() < deadline:
        maintain(pools, counts)
        if all(r.is_finished for r in records if not r.refresh_from_db()) and _quiet():
            break
        time.sleep(1)
    for pool in pools.pools:
        pool.stop()
    return {"counts": counts, "pools_started": pools.started, "duration_s": args.duration,
            "checks": check(records, root, mail_dir)}


def _quiet() -> bool:
    from budgets.models import Reservation, ReservationStatus
    from exports.models import ExportRecord

    return (not Reservation.objects.filter(status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).exists()
            and not ExportRecord.objects.filter(status="succeeded", notified_at__isnull=True).exists())


def report(results: dict) -> None:
    c, k = results["counts"], results["checks"]
    rows = [[name, str(value)] for name, value in (
        ("broker", results["broker"]), ("chaos seconds", results["duration_s"]),
        *((f"blows: {b}", c[b]) for b in BLOWS), ("connections dropped", c["connections_dropped"]),
        ("pools started (incl. restarts)", results["pools_started"]), ("stalled-pool restarts", c["stall_restarts"]),
        ("exports re-sent / notices sent by the reconciler", c["reconciled"]),
        ("exports requested", k["exports"]), ("succeeded", k["succeeded"]),
        ("one object + manifest each", k["one_object_each"]), ("bytes match checksum", k["bytes_match"]),
        ("exactly one notice each", k["one_notice_each"]), ("ledger CPU ms", k["ledger_cpu_ms"]),
        ("recorded CPU ms of admitted runs", k["recorded_cpu_ms"]), ("CPU ms left reserved", k["reserved_ms_left"]),
        ("slots left", k["slots_left"]), ("runs by outcome", k["runs_by_outcome"]), ("all checks", k["ok"]),
    )]
    print(h.render_table(["", "value"], rows, right={1}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="12 exports, 60 s of chaos")
    p.add_argument("--exports", type=int, help="exports requested during the chaos (default 36; 12 with --quick)")
    p.add_argument("--duration", type=float, help="seconds of chaos (default 180; 60 with --quick)")
    p.add_argument("--rows", type=int, default=3000, help="activity rows per account (the size of each export)")
    p.add_argument("--pools", type=int, default=2, help="exports qcluster pools")
    p.add_argument("--broker", choices=["orm", "redis"], default="orm")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9"))
    p.add_argument("--drain-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    p.add_argument("--json", type=Path, help="results file (default bench/results/chaos-<broker>[-quick].json)")
    args = p.parse_args()
    args.exports = args.exports or (12 if args.quick else 36)
    args.duration = args.duration or (60 if args.quick else 180)
    os.environ.update(DRIVER_ENV)
    db_url = h.prepare(args.db_name, fresh=True, drop=args.drop)
    if args.broker == "redis":
        use_redis(args.redis_url)
    with tempfile.TemporaryDirectory(prefix="fairshare-chaos-") as work:
        results = {"broker": args.broker, **run_chaos(args, Path(work)), "machine": h.machine_info(db_url)}
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    report(results)
    h.write_results(args.json or h.RESULTS_DIR / f"chaos-{args.broker}{'-quick' if args.quick else ''}.json", results)
    return 0 if results["checks"]["ok"] else 1


if __name__ == "__main__":
    h.run(main)
