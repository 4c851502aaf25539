#!/usr/bin/env python
"""Soak: SIGKILL random workers of one pool while work flows. Does a killed worker ever stall its
pool, lose a job or run one twice? (scheduling.pool; SPEC §4: no duplicate or lost results.)

    .venv/bin/python bench/worker_kills.py                     # 100 kills, ORM broker
    .venv/bin/python bench/worker_kills.py --broker redis      # the same on Redis (FAIRSHARE_TEST_REDIS_URL,
                                                               # or --redis-url: that database is flushed)
    .venv/bin/python bench/worker_kills.py --broker rabbitmq   # and on RabbitMQ (FAIRSHARE_TEST_RABBITMQ_URL,
                                                               # or --rabbitmq-url: queues of this run's own)
    .venv/bin/python bench/worker_kills.py --kills 20          # a quick look

One real `qcluster` of the default queue, two workers, under a supervising thread that starts it
again should it exit (scheduling.processes.Supervisor: a stalled pool ends itself, scheduling.stuck);
the benchmark's own database. One account (4 slots) sends `tests.sleep` jobs of 50-400 ms, keeping
a few waiting. Every 0.5-2 s one worker of the pool, picked at random, is SIGKILLed: mostly busy;
before about a third of the kills the flow pauses until both workers are idle (then the kill is of
an idle worker, waiting for its next task). Jobs sent right after each kill keep the pool fed.

Per kill: how long after it a job started (the first run started after the kill; work was waiting
at every kill). A *stall*: none started within 10 s. After the kills this process waits for every
job to end (a run killed mid-way is recorded lost and its slot given back by its pool's sentinel at
once, scheduling.deaths; this process also runs the reclaim, the last resort, every half second for
3-second leases), and on the ORM broker for every message to be acknowledged (a job killed running is
delivered again after `retry`, 70 s here, and runs again). Then it checks what a user would: no job
lost (every job has a run), none succeeded twice, the usage ledger equal to what the runs that held
a slot recorded, nothing left reserved. Exit 1 if a check fails. JSON: bench/results/worker_kills-<broker>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402

DEFAULT_DB_NAME = "fairshare_bench_worker_kills"
STALL_S = 10  # no job started this long after a kill: the pool stalled
TASK_TIMEOUT_S = 10  # the ORM broker delivers an unacknowledged message again after this + 60 s
FAST = {"FAIRSHARE_RESERVATION_LEASE": "3", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5", "FAIRSHARE_WORKER_HEARTBEAT": "1",
        "FAIRSHARE_RELEASE_POLL": "0.2", "FAIRSHARE_TASK_TIMEOUT": str(TASK_TIMEOUT_S),
        "FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE": "5"}
# A job whose worker was killed after it started the task and before its run's admission has its slot
# dispatched and no run. The ORM broker delivers its message again after `retry` (70 s); on Redis the
# message is gone and the dispatch lease holds the job again. The lease must be longer than `retry`
# on the ORM broker: shorter, the job held again runs, and then its message comes back and runs too.
# On RabbitMQ the message of a worker killed running it goes again RABBITMQ_REDELIVER_AFTER_DEATH_S
# after the death (shortened here: a sleep job holds no export lease), within its dispatch lease too.
DISPATCH_LEASE_S = {"orm": 80, "redis": 20, "rabbitmq": 30}
RABBITMQ_REDELIVER_AFTER_DEATH_S = 10
RABBITMQ_PREFIX = f"fairshare-kills-{os.getpid()}"
HOST = socket.gethostname()


def workers(cluster) -> dict[int, bool]:
    """The live workers of `cluster` (by heartbeat, in its session, not dead), each with whether it
    is running a job."""
    from scheduling.models import Outcome, TaskRun, WorkerHeartbeat

    running = set(TaskRun.objects.filter(outcome=Outcome.RUNNING).values_list("worker", flat=True))
    found = {}
    for worker in WorkerHeartbeat.objects.filter(queue="default").values_list("worker", flat=True):
        pid = int(worker.rsplit(":", 1)[1])
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z" and os.getsid(pid) == cluster.pid:
                found[pid] = worker in running
        except (OSError, IndexError):
            pass
    return found


class Flow:
    """Jobs sent to the pool, a few waiting at all times while `on`."""

    def __init__(self, account_id: int, rng: random.Random):
        self.account_id, self.rng, self.sent, self.on = account_id, rng, [], True
        self.last_kill = 0.0  # time.monotonic() of the last SIGKILL

    def waiting(self) -> int:
        from scheduling.models import TaskRun

        recent = self.sent[-50:]
        return len(recent) - TaskRun.objects.filter(ref__in=recent).values("ref").distinct().count()

    def send(self, n: int = 1) -> None:
        from scheduling.runtime import enqueue

        for _ in range(n):
            ref = f"{self.rng.randint(50, 400)}/{len(self.sent)}"
            enqueue(job="tests.sleep", account=self.account_id, ref=ref)
            self.sent.append(ref)

    def feed(self) -> None:
        if self.on and self.waiting() < 3:
            self.send(2)


def maintain() -> None:
    from budgets.reclaim import reclaim_expired

    try:
        reclaim_expired()
    except Exception as exc:
        h.log(f"reclaim failed ({type(exc).__name__})")


def wait_idle(supervisor, flow: Flow, timeout: float = 5) -> bool:
    """Pause the flow until both workers are idle and nothing waits (False: not within `timeout`)."""
    flow.on = False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = workers(supervisor.cluster)
        if len(live) == 2 and not any(live.values()) and flow.waiting() == 0:
            time.sleep(0.3)  # into their wait for the next task
            return True
        maintain()
        time.sleep(0.1)
    return False


def soak(args, supervisor, flow: Flow, rng: random.Random) -> list[dict]:
    kills = []
    while len(kills) < args.kills:
        idle_kill = rng.random() < 1 / 3 and wait_idle(supervisor, flow)
        live = workers(supervisor.cluster)
        if not live:  # both just died: wait for their replacements' first heartbeat
            flow.feed()
            time.sleep(0.1)
            continue
        pid = rng.choice(sorted(live))
        os.kill(pid, signal.SIGKILL)
        killed_at = dt.datetime.now(dt.UTC)
        flow.on = True
        flow.send(2)  # work waits at every kill
        kills.append({"at": killed_at, "pid": pid, "busy": live[pid], "idle_kill": idle_kill})
        flow.last_kill = time.monotonic()
        pause_until = time.monotonic() + rng.uniform(*args.kill_interval)
        while time.monotonic() < pause_until:
            flow.feed()
            maintain()
            time.sleep(0.05)
        if len(kills) % 10 == 0:
            h.log(f"{len(kills)} kills")
    return kills


def drain(args, supervisor, flow: Flow) -> bool:
    from django_q.models import OrmQ

    from budgets.models import Reservation, ReservationStatus
    from scheduling.models import Outcome, TaskRun

    flow.on = False
    deadline = time.monotonic() + args.drain_timeout
    while time.monotonic() < deadline:
        maintain()
        ended = TaskRun.objects.filter(ref__in=flow.sent).values("ref").distinct().count() == len(flow.sent)
        quiet = (not TaskRun.objects.filter(outcome=Outcome.RUNNING).exists()
                 and not Reservation.objects.exclude(status=ReservationStatus.RECLAIMED).exists())
        # (RabbitMQ: the copy of a message whose worker was killed running it comes after a while.)
        redelivered = args.broker != "rabbitmq" or time.monotonic() > flow.last_kill + RABBITMQ_REDELIVER_AFTER_DEATH_S + 5
        if ended and quiet and redelivered and (args.broker != "orm" or not OrmQ.objects.exists()):
            return True
        time.sleep(0.5)
    return False


def measure(kills: list[dict], flow: Flow, account_id: int) -> dict:
    from django.db.models import Sum

    from budgets import clock
    from budgets.models import Reservation, ReservationStatus, UsageDay
    from scheduling.models import Outcome, TaskRun

    starts = sorted(TaskRun.objects.filter(account_id=account_id).values_list("started_at", flat=True))
    for kill in kills:
        first = next((s for s in starts if s > kill["at"]), None)
        kill["waited_s"] = None if first is None else round((first - kill["at"]).total_seconds(), 3)
    waits = [k["waited_s"] if k["waited_s"] is not None else float("inf") for k in kills]
    runs: dict[str, list[str]] = {}
    for ref, outcome in TaskRun.objects.filter(account_id=account_id).order_by("started_at").values_list("ref", "outcome"):
        runs.setdefault(ref, []).append(outcome)
    charged = TaskRun.objects.filter(account_id=account_id, outcome__in=[
        Outcome.SUCCEEDED, Outcome.FAILED, Outcome.BUDGET_EXHAUSTED, Outcome.LOST])
    usage = UsageDay.objects.filter(account_id=account_id, queue="default", day=clock.budget_day()).first()
    killed_running = [ref for ref, outcomes in runs.items() if Outcome.LOST in outcomes]
    checks = {
        "jobs": len(flow.sent),
        "succeeded_once": sum(runs.get(ref, []).count(Outcome.SUCCEEDED) == 1 for ref in flow.sent),
        "killed_running_run_lost": len(killed_running),
        "killed_running_ran_again": sum(Outcome.SUCCEEDED in runs[ref] for ref in killed_running),
        "lost": [ref for ref in flow.sent if ref not in runs],
        "succeeded_twice": [ref for ref in flow.sent if runs.get(ref, []).count(Outcome.SUCCEEDED) > 1],
        # (deferred: admission held the job, its account's 4 slots taken, some by runs killed
        # mid-way until their reclaim; it ran later. skipped: with the hand-off, a claimed job whose
        # claim expired and that was released to run elsewhere)
        "other_outcomes": sorted({o for outcomes in runs.values() for o in outcomes}
                                 - {Outcome.SUCCEEDED, Outcome.LOST, Outcome.DEFERRED, Outcome.SKIPPED}),
        "ledger_cpu_ms": usage.cpu_used_ms if usage else 0, "recorded_cpu_ms": charged.aggregate(s=Sum("cpu_ms"))["s"] or 0,
        "ledger_runs": usage.runs if usage else 0, "recorded_runs": charged.count(),
        "reserved_ms_left": usage.cpu_reserved_ms if usage else 0,
        "slots_left": Reservation.objects.exclude(status=ReservationStatus.RECLAIMED).count(),
    }
    checks["succeeded_twice_why"] = [_why_twice(ref, account_id, kills) for ref in checks["succeeded_twice"]]
    checks["ok"] = (not checks["lost"] and not checks["succeeded_twice"] and not checks["other_outcomes"]
                    and checks["ledger_cpu_ms"] == checks["recorded_cpu_ms"] and checks["ledger_runs"] == checks["recorded_runs"]
                    and checks["reserved_ms_left"] == 0 and checks["slots_left"] == 0)
    return {
        "kills": len(kills), "busy_kills": sum(k["busy"] for k in kills), "idle_kills": sum(not k["busy"] for k in kills),
        "longest_wait_after_kill_s": max(waits, default=None), "p50_wait_after_kill_s": h.median(waits),
        "p95_wait_after_kill_s": h.percentile(waits, 95), "stalls": sum(w > STALL_S for w in waits),
        "checks": checks, "kill_log": [{**k, "at": k["at"].isoformat()} for k in kills],
    }


def _why_twice(ref: str, account_id: int, kills: list[dict]) -> dict:
    """A job that succeeded twice: was the worker of its first run killed after that run ended, before
    the broker's message was acknowledged (then the ORM broker delivers it again after `retry`)?"""
    from scheduling.models import Outcome, TaskRun

    first, second = TaskRun.objects.filter(account_id=account_id, ref=ref, outcome=Outcome.SUCCEEDED).order_by(
        "started_at").values("worker", "started_at", "finished_at")[:2]
    killed = next((k["at"] for k in kills if f"{HOST}:{k['pid']}" == first["worker"]), None)
    return {"ref": ref, "first_run_ended_s_before_its_worker_was_killed":
            None if killed is None else round((killed - first["finished_at"]).total_seconds(), 3),
            "second_run_started_s_after_the_first": round((second["started_at"] - first["started_at"]).total_seconds(), 1)}


def run(args, work: Path) -> dict:
    from budgets.models import Account, Budget
    from scheduling.processes import Supervisor

    h.reset_tables(*h.RUN_TABLES, "scheduling.WorkerHeartbeat")
    account, _ = Account.objects.get_or_create(slug="kills", defaults={"name": "kills"})
    Budget.objects.update_or_create(account=account, queue="default",
                                    defaults={"cpu_seconds_per_day": 1_000_000, "max_concurrent": 4})
    env = h.cluster_env(workers=2, poll=0.1, **FAST, FAIRSHARE_HANDOFF_MAX_RUNS=str(args.handoff_max_runs),
                        **({"REDIS_URL": args.redis_url} if args.broker == "redis" else {}),
                        **({"RABBITMQ_URL": args.rabbitmq_url, "FAIRSHARE_RABBITMQ_PREFIX": RABBITMQ_PREFIX,
                            "FAIRSHARE_RABBITMQ_REDELIVER_AFTER_DEATH_S": str(RABBITMQ_REDELIVER_AFTER_DEATH_S)}
                           if args.broker == "rabbitmq" else {}))
    logs = []

    def start():
        logs.append(work / f"qcluster-{len(logs)}.log")
        return h.start_cluster(env, logs[-1])

    supervisor = Supervisor(start)
    h.at_exit(supervisor.stop)
    rng = random.Random(args.seed)
    flow = Flow(account.pk, rng)
    h.wait_until(lambda: len(workers(supervisor.cluster)) == 2, timeout=90, what="two workers", cluster=supervisor.cluster)
    started = time.monotonic()
    kills = soak(args, supervisor, flow, rng)
    soak_s = time.monotonic() - started
    h.log("kills done; waiting for every job to end")
    drained = drain(args, supervisor, flow)
    supervisor.stop()
    handed_on = sum(path.read_text(errors="replace").count("it goes to the next ready worker") for path in logs)
    given_back = sum(path.read_text(errors="replace").count("given back at once") for path in logs)
    results = measure(kills, flow, account.pk)
    results["checks"]["drained"] = drained
    results["checks"]["ok"] = results["checks"]["ok"] and drained
    return {**results, "soak_s": round(soak_s, 1), "tasks_handed_on": handed_on, "deaths_given_back": given_back,
            "pool_exits": supervisor.exits, "pools_started": len(logs)}


def report(results: dict) -> None:
    c = results["checks"]
    rows = [[name, str(value)] for name, value in (
        ("broker", results["broker"]), ("hand-off runs per message (0: off)", results["handoff_max_runs"]),
        ("soak seconds", results["soak_s"]),
        ("SIGKILLs (busy / idle workers)", f"{results['kills']} ({results['busy_kills']} / {results['idle_kills']})"),
        ("tasks a dead worker had not run, handed to the next", results["tasks_handed_on"]),
        ("deaths whose slots and claims the sentinel gave back at once", results["deaths_given_back"]),
        ("longest wait for a start after a kill (s)", results["longest_wait_after_kill_s"]),
        ("median / p95 wait after a kill (s)", f"{h.fmt(results['p50_wait_after_kill_s'], '.3f')} / "
                                               f"{h.fmt(results['p95_wait_after_kill_s'], '.3f')}"),
        (f"stalls (no start within {STALL_S} s of a kill)", results["stalls"]),
        ("pools that ended themselves", results["pool_exits"] or "none"),
        ("jobs sent", c["jobs"]), ("succeeded once", c["succeeded_once"]),
        ("killed running: run recorded lost", c["killed_running_run_lost"]),
        ("  of which ran again (broker redelivery)", c["killed_running_ran_again"]),
        ("lost (never ran)", len(c["lost"])), ("succeeded twice", len(c["succeeded_twice"])),
        ("  of which the worker was killed between the run's end and the ack", sum(
            w["first_run_ended_s_before_its_worker_was_killed"] is not None for w in c["succeeded_twice_why"])),
        ("ledger CPU ms / recorded", f"{c['ledger_cpu_ms']} / {c['recorded_cpu_ms']}"),
        ("ledger runs / recorded", f"{c['ledger_runs']} / {c['recorded_runs']}"),
        ("CPU ms left reserved, slots left", f"{c['reserved_ms_left']}, {c['slots_left']}"),
        ("all checks", c["ok"]),
    )]
    print(h.render_table(["", "value"], rows, right={1}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=100)
    p.add_argument("--kill-interval", type=lambda v: tuple(float(x) for x in v.split(",")), default=(0.5, 2.0),
                   help="seconds between kills, MIN,MAX (default 0.5,2)")
    p.add_argument("--broker", choices=["orm", "redis", "rabbitmq"], default="orm")
    p.add_argument("--rabbitmq-url", default=os.environ.get("FAIRSHARE_TEST_RABBITMQ_URL")
                   or "amqp://guest:guest@127.0.0.1:5672/%2F", help="with --broker rabbitmq: the server")
    p.add_argument("--redis-url", default=os.environ.get("FAIRSHARE_TEST_REDIS_URL"),
                   help="with --broker redis: a Redis database of this benchmark's own (flushed)")
    p.add_argument("--handoff-max-runs", type=int, default=500,
                   help="FAIRSHARE_HANDOFF_MAX_RUNS of the pool (default the product's, 500; 0: no hand-off, no pull)")
    p.add_argument("--keep-db", action="store_true", help="keep the benchmark's database at the end, to look at")
    p.add_argument("--drain-timeout", type=float, default=240)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--db-name", default=DEFAULT_DB_NAME)
    p.add_argument("--json", type=Path, help="results file (default bench/results/worker_kills-<broker>.json)")
    args = p.parse_args()
    if args.broker == "redis" and not args.redis_url:
        p.error("--broker redis needs --redis-url or FAIRSHARE_TEST_REDIS_URL")
    os.environ.update(FAST, FAIRSHARE_DISPATCH_LEASE=str(DISPATCH_LEASE_S[args.broker]))  # this process sends and reclaims
    db_url = h.prepare(args.db_name, fresh=True, drop=not args.keep_db)
    if args.broker == "redis":
        import redis
        from django_q.conf import Conf

        redis.from_url(args.redis_url).flushdb()
        Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = None, None, args.redis_url
    if args.broker == "rabbitmq":
        from django.conf import settings
        from django_q.conf import Conf

        from scheduling.rabbitmq import RabbitMQ

        Conf.BROKER_CLASS, Conf.ORM, Conf.REDIS = "scheduling.rabbitmq.RabbitMQ", None, None
        settings.RABBITMQ_URL = args.rabbitmq_url
        settings.FAIRSHARE = {**settings.FAIRSHARE, "RABBITMQ_PREFIX": RABBITMQ_PREFIX}
        h.at_exit(lambda: RabbitMQ("default").delete_queue())
    with tempfile.TemporaryDirectory(prefix="fairshare-kills-") as work:
        results = {"broker": args.broker, "handoff_max_runs": args.handoff_max_runs, "when": h.utc_timestamp(),
                   **run(args, Path(work)),
                   "machine": h.machine_info(db_url)}
    results["machine"]["loadavg_end"] = list(os.getloadavg())
    report(results)
    h.print_load(results)
    h.write_results(args.json or h.RESULTS_DIR / f"worker_kills-{args.broker}.json", results)
    return 0 if results["checks"]["ok"] and not results["stalls"] else 1


if __name__ == "__main__":
    h.run(main)
