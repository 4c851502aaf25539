#!/usr/bin/env python
"""Randomized kill loop: do exports survive random SIGKILLs, pool kills, whole-server restarts and
dropped database connections? (SPEC §4: no duplicate or lost results, whatever crashes.)

    .venv/bin/python bench/chaos.py                       # 36 exports, 3 minutes of chaos, ORM broker
    .venv/bin/python bench/chaos.py --broker redis        # the same on the Redis broker
    .venv/bin/python bench/chaos.py --quick               # 12 exports, 60 s
    .venv/bin/python bench/chaos.py --blows restart_postgres --exports 4 --duration 30   # one kind only

Everything runs on servers of the benchmark's own, started here and removed at the end: a private
PostgreSQL (`initdb` + `pg_ctl` in a temporary folder, a free port) and, with `--broker redis`, a
private `redis-server` keeping nothing on disk (scheduling.servers `PrivatePostgres`,
`PrivateRedis`). The machine's shared servers are never restarted. Two real `qcluster` pools of the
exports queue (two workers each); three accounts (one export at a time, two, and four) with their
activity rows. Exports are requested through the whole chaos phase. Every 1-4 s
(`--blow-interval`) one random blow:

- `kill_worker`: SIGKILL one worker process of a pool (it may hold the pool's queue lock: the
  pool can stall, and then ends itself, see below);
- `kill_pool`: SIGKILL a whole pool (its session), then start it again;
- `stop_pool`: SIGTERM to a pool's main PID (graceful), SIGKILL after 10 s, start it again;
- `drop_connections`: `pg_terminate_backend` of every worker database connection;
- `restart_postgres`: a fast restart of the whole PostgreSQL server (every session cut);
- `restart_redis` (Redis broker only): SIGKILL and start again of the Redis server: every message
  in it is lost;
- `freeze_worker` (only when named in `--blows`): SIGSTOP a worker for longer than its leases,
  SIGCONT after (a VM pause).

This process plays the schedules and the supervisor: every half second it runs reclaim_expired,
task_runs_sweep_lost and reconcile_exports; it starts again a pool that exited (as systemd's
`Restart=always`: a stalled pool ends itself, scheduling.stuck), and, should one stay stalled
after all, restarts a pool whose queue /healthz calls stalled. After the chaos it waits for every
export to finish, then checks what a user would check and prints a table: every export succeeded,
once (one object and one manifest under its key, bytes matching its checksum), one "export ready"
notice each, the usage ledger equal to the CPU recorded by the runs that held a slot, nothing left
reserved, and no account with more runs at once than its cap. Exit 1 if any check fails.
"""
from __future__ import annotations

import argparse
import contextlib
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
from scheduling.servers import PrivatePostgres, PrivateRedis  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_chaos"
ACCOUNTS = (("chaos-1", 1), ("chaos-2", 2), ("chaos-4", 4))  # slug, exports max_concurrent
RANGE = (dt.date(2026, 3, 1), dt.date(2026, 3, 31))
BLOWS = ("kill_worker", "kill_pool", "stop_pool", "drop_connections", "restart_postgres", "restart_redis",
         "freeze_worker")
# Named with --blows only: a frozen worker that wakes in a slot reclaimed meanwhile is issue 24's
# part 1 (budgets), whose cap the table checks.
NOT_BY_DEFAULT = {"freeze_worker"}
FREEZE_S = 6  # above the leases below (3 s): the frozen worker's slot and export are reclaimed
# Fast recovery, as in the crash tests: leases of seconds, small batches, a fast pulse.
WORKER_ENV = {
    "FAIRSHARE_EXPORT_WORKERS": "2", "FAIRSHARE_EXPORT_BATCH_ROWS": "200", "FAIRSHARE_EXPORT_LEASE": "3",
    "FAIRSHARE_RESERVATION_LEASE": "3", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5", "FAIRSHARE_RELEASE_POLL": "0.2",
    "FAIRSHARE_WORKER_HEARTBEAT": "1", "FAIRSHARE_EXPORT_RETRY": "60", "FAIRSHARE_EXPORT_TIMEOUT": "50",
    "FAIRSHARE_EXPORT_ATTEMPT_DEADLINE": "40",
    # A pool that stalls (its queue lock lost with a killed worker) ends itself after 15 s.
    "FAIRSHARE_QUEUE_STALL_AFTER_S": "10", "FAIRSHARE_STALLED_POOL_EXIT_AFTER_S": "15",
}
# This process: the reconciler re-sends after 5 s, and a queue is called stalled after 30 s (a pool
# that stalls ends itself after 15 s: this process restarts one only if it did not). Its
# health readings expect the workers' 1-second heartbeat (else system check scheduling.E003 stops
# its `migrate`: a 5-second max age under the default 10-second heartbeat).
DRIVER_ENV = {"FAIRSHARE_EXPORT_STALE_AFTER": "5", "FAIRSHARE_QUEUE_STALL_AFTER_S": "30",
              "FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE": "5", "FAIRSHARE_WORKER_HEARTBEAT": "1"}


class Pools:
    def __init__(self, env: dict[str, str], logs: Path, count: int):
        self.env, self.logs, self.started = env, logs, 0
        self.stall_restart_at = 0.0
        self.exits: list[int] = []  # exit codes of pools that ended by themselves
        self.pools = [self._start() for _ in range(count)]

    def supervise(self) -> None:
        """What systemd's Restart=always does: start again a pool that exited by itself."""
        for index, pool in enumerate(self.pools):
            if not pool.alive():
                self.exits.append(pool.returncode)
                h.log(f"pool {pool.pid} exited ({pool.returncode}): starting it again")
                pool.stop(timeout=0)
                self.pools[index] = self._start()

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


class Servers:
    """The benchmark's own PostgreSQL (and Redis) servers, and the workers it froze."""

    def __init__(self, postgres, redis=None):
        self.postgres, self.redis = postgres, redis
        self.frozen: dict[int, float] = {}  # pid -> time.monotonic() to resume it

    def thaw(self, *, everyone: bool = False) -> None:
        for pid, at in list(self.frozen.items()):
            if everyone or time.monotonic() >= at:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                del self.frozen[pid]


def blow(kind: str, pools: Pools, servers: Servers, rng: random.Random, counts: dict) -> None:
    from django.db import connection

    index = rng.randrange(len(pools.pools))
    if kind in ("kill_worker", "freeze_worker"):
        pids = [pid for pid in pools.worker_pids(index) if pid not in servers.frozen]
        if not pids:
            return
        pid = rng.choice(pids)
        if kind == "freeze_worker":
            os.kill(pid, signal.SIGSTOP)
            servers.frozen[pid] = time.monotonic() + FREEZE_S
        else:
            os.kill(pid, signal.SIGKILL)
    elif kind in ("kill_pool", "stop_pool"):
        pools.restart(index, graceful=kind == "stop_pool")
    elif kind == "restart_postgres":
        servers.postgres.restart()
        connection.close()  # ours was cut too
    elif kind == "restart_redis":
        servers.redis.restart()
    else:
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                           "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                           "AND backend_type = 'client backend'")
            counts["connections_dropped"] += cursor.fetchone()[0]
    counts[kind] += 1


def maintain(pools: Pools, counts: dict) -> None:
    """What the schedules and the supervisor do: reclaim, reconcile, restart a stalled pool."""
    from budgets.reclaim import reclaim_expired
    from exports.maintenance import reconcile_exports
    from scheduling.liveness import queue_health
    from scheduling.connections import close_old_connections
    from scheduling.services import task_runs_sweep_lost

    pools.supervise()
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
    result["cap_exceeded_by"] = _cap_exceeded_by(admitted)
    # What went wrong in a run that did not succeed, and what it charged (for the reader of a failure).
    result["unsuccessful_runs"] = [
        {"ref": r.ref, "outcome": r.outcome, "error_class": r.error_class, "cpu_ms": r.cpu_ms, "worker": r.worker,
         "started_at": r.started_at, "finished_at": r.finished_at}
        for r in TaskRun.objects.filter(job=BUILD_JOB).exclude(outcome=Outcome.SUCCEEDED).order_by("started_at")]
    result["runs_by_outcome"] = dict(sorted(
        (o, TaskRun.objects.filter(job=BUILD_JOB, outcome=o).count()) for o in Outcome.values
        if TaskRun.objects.filter(job=BUILD_JOB, outcome=o).exists()))
    n = len(records)
    result["ok"] = (result["succeeded"] == result["one_object_each"] == result["bytes_match"]
                    == result["one_notice_each"] == n and result["ledger_cpu_ms"] == result["recorded_cpu_ms"]
                    and result["reserved_ms_left"] == 0 and result["slots_left"] == 0
                    and not result["cap_exceeded_by"])
    return result


def _cap_exceeded_by(admitted) -> dict[str, int]:
    """Per account whose recorded runs overlapped more than its cap: by how many at most. A run's
    interval is its TaskRun's start to finish (a killed run's finish is when it was reclaimed,
    which is when its slot went to the next run)."""
    from budgets.models import Budget

    caps = dict(Budget.objects.filter(queue="exports").values_list("account__slug", "max_concurrent"))
    exceeded = {}
    for slug, cap in caps.items():
        edges = sorted(edge for run in admitted.filter(account__slug=slug, finished_at__isnull=False)
                       for edge in ((run.started_at, 1), (run.finished_at, -1)))  # a finish before a start
        running = most = 0
        for _, step in edges:
            running += step
            most = max(most, running)
        if most > cap:
            exceeded[slug] = most - cap
    return exceeded


def use_redis(url: str) -> None:
    import redis
    from django_q.conf import Conf

    redis.from_url(url).flushdb()
    Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = None, None, url


def run_chaos(args, work: Path, servers: Servers) -> dict:
    from config.mail import FILE_BACKEND, mail_to_folder
    from exports.requests import export_request

    mail_dir, root, logs = work / "mail", work / "exports-root", work / "logs"
    for path in (mail_dir, root, logs):
        path.mkdir()
    owners = setup(args, mail_dir)
    env = h.cluster_env(workers=2, poll=0.2, **WORKER_ENV, FAIRSHARE_EXPORTS_ROOT=str(root),
                        EMAIL_BACKEND=FILE_BACKEND, EMAIL_FILE_PATH=str(mail_dir))
    if args.broker == "redis":
        env["REDIS_URL"] = servers.redis.url(9)
    from django.conf import settings

    settings.STORAGES["exports"]["OPTIONS"]["location"] = str(root)
    mail_to_folder(settings, mail_dir)
    rng = random.Random(args.seed)
    counts = dict.fromkeys((*BLOWS, "connections_dropped", "reconciled", "stall_restarts"), 0)
    low, high = args.blow_interval
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
            kind = rng.choice(args.blows)
            h.log(f"blow: {kind}")
            try:
                blow(kind, pools, servers, rng, counts)
            except Exception as exc:  # e.g. the database restarting under our own connection
                h.log(f"blow {kind} failed ({type(exc).__name__}); next one")
            next_blow = now + rng.uniform(low, high)
        servers.thaw()
        maintain(pools, counts)
        time.sleep(0.5)
    servers.thaw(everyone=True)
    h.log("chaos over; waiting for every export to finish")
    deadline = time.monotonic() + args.drain_timeout
    while time.monotonic() < deadline:
        maintain(pools, counts)
        if all(r.is_finished for r in records if not r.refresh_from_db()) and _quiet():
            break
        time.sleep(1)
    for pool in pools.pools:
        pool.stop()
    return {"counts": counts, "pools_started": pools.started, "pool_exits": pools.exits,
            "duration_s": args.duration, "blows": args.blows, "checks": check(records, root, mail_dir)}


def _quiet() -> bool:
    from budgets.models import Reservation, ReservationStatus
    from exports.models import ExportRecord

    return (not Reservation.objects.filter(status__in=[ReservationStatus.ACTIVE, ReservationStatus.DISPATCHED]).exists()
            and not ExportRecord.objects.filter(status="succeeded", notified_at__isnull=True).exists())


def report(results: dict) -> None:
    c, k = results["counts"], results["checks"]
    rows = [[name, str(value)] for name, value in (
        ("broker", results["broker"]), ("chaos seconds", results["duration_s"]),
        *((f"blows: {b}", c[b] if b in results["blows"] else "-") for b in BLOWS),
        ("connections dropped", c["connections_dropped"]),
        ("pools started (incl. restarts)", results["pools_started"]),
        ("pools that ended themselves (exit codes)", results["pool_exits"] or "none"),
        ("stalled pools restarted by this process", c["stall_restarts"]),
        ("exports re-sent / notices sent by the reconciler", c["reconciled"]),
        ("exports requested", k["exports"]), ("succeeded", k["succeeded"]),
        ("one object + manifest each", k["one_object_each"]), ("bytes match checksum", k["bytes_match"]),
        ("exactly one notice each", k["one_notice_each"]), ("ledger CPU ms", k["ledger_cpu_ms"]),
        ("recorded CPU ms of admitted runs", k["recorded_cpu_ms"]), ("CPU ms left reserved", k["reserved_ms_left"]),
        ("slots left", k["slots_left"]), ("accounts over their cap (by)", k["cap_exceeded_by"] or "none"),
        ("runs by outcome", k["runs_by_outcome"]), ("all checks", k["ok"]),
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
    p.add_argument("--blows", type=lambda v: [b for b in v.split(",") if b],
                   help=f"comma-separated kinds of blow (default: all but {', '.join(sorted(NOT_BY_DEFAULT))}; "
                        "restart_redis only on the Redis broker)")
    p.add_argument("--blow-interval", type=lambda v: tuple(float(x) for x in v.split(",")), default=(1.0, 4.0),
                   help="seconds between blows, MIN,MAX (default 1,4)")
    p.add_argument("--drain-timeout", type=float, default=300)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--json", type=Path, help="results file (default bench/results/chaos-<broker>[-quick].json)")
    args = p.parse_args()
    args.exports = args.exports or (12 if args.quick else 36)
    args.duration = args.duration or (60 if args.quick else 180)
    applicable = [b for b in BLOWS if b not in NOT_BY_DEFAULT and (b != "restart_redis" or args.broker == "redis")]
    args.blows = args.blows or applicable
    unknown = set(args.blows) - set(BLOWS) | ({"restart_redis"} & set(args.blows) if args.broker == "orm" else set())
    if unknown:
        p.error(f"unknown or inapplicable blows: {', '.join(sorted(unknown))}")
    os.environ.update(DRIVER_ENV)
    h.install_cleanup()
    servers = Servers(PrivatePostgres(), PrivateRedis() if args.broker == "redis" else None)
    h.at_exit(servers.postgres.remove)  # last: after every pool has stopped (cleanups run newest first)
    if servers.redis:
        h.at_exit(servers.redis.remove)
    h.at_exit(lambda: servers.thaw(everyone=True))
    os.environ["BENCH_DATABASE_URL"] = servers.postgres.url(args.db_name)
    db_url = h.prepare(args.db_name, fresh=True, drop=False)
    if args.broker == "redis":
        use_redis(servers.redis.url(9))
    with tempfile.TemporaryDirectory(prefix="fairshare-chaos-") as work:
        results = {"broker": args.broker, **run_chaos(args, Path(work), servers), "machine": h.machine_info(db_url)}
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    report(results)
    h.write_results(args.json or h.RESULTS_DIR / f"chaos-{args.broker}{'-quick' if args.quick else ''}.json", results)
    return 0 if results["checks"]["ok"] else 1


if __name__ == "__main__":
    h.run(main)
