#!/usr/bin/env python
"""The usage log's costs (issue 42): the chain with usage events on against off, and the replay rate.

    .venv/bin/python bench/usage_log.py                      # chain 2,000 jobs x 3 rounds; replay 1,000,000 events
    .venv/bin/python bench/usage_log.py --jobs 1000 --rounds 2 --events 200000
    .venv/bin/python bench/usage_log.py --skip-chain         # the settlement alone and the replay

1. The chain, as bench/peers.py measures it (its `measure`: a fresh database per system and round,
   N no-op jobs enqueued, then two workers drain them; jobs/s, machine CPU and the CPU of the
   system's own processes per 1,000 jobs), with usage events off (`fairshare-chain`) and on
   (`fairshare-chain-events`: the workers' connections write the outbox, and a `usage_relay`
   process, counted in its own CPU, publishes to a private nats-server), alternating in each round.
   The relay's lag (events in the outbox, age of the oldest) is sampled every 10th poll; its
   maximum over the drain says whether the relay keeps up. Goal: events on costs <= 10% of jobs/s
   and of CPU per job.
2. The settlement alone: C cycles of S settlements each way (a slot activated, then charged:
   budgets.ledger, one process, one connection) with the session's `fairshare_usage.events` off
   and on, alternating; each charge's PostgreSQL backend CPU timed on its own
   (/proc/<pid>/schedstat, ns): quartiles, what the event adds to a settlement without the chain's
   processes around it.
3. Replay: N events (default 1,000,000, shaped as the relay publishes them, 50 accounts, 2 queues,
   7 days) published to a stream of a private nats-server, then `usage.replay.read_stream` +
   `rebuild` (what `usage_replay` does) times reading them back and summing them: events/s.

A private nats-server (`nats-server -js`, a free port, its store in a temporary folder deleted
afterwards) for both. Results: a table on stdout, JSON in bench/results/usage_log.json. Not part of
.ci/run. On a shared machine print and read the load with the figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import harness as h  # noqa: E402
from bench import peers  # noqa: E402

LAG_EVERY = 10  # polls between two samples of the relay's lag
# Databases of its own (not bench/peers.py's names: the two may run on one server at once).
DB_PREFIX = "fairshare_usage_log"


def start_nats(store: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["nats-server", "-js", "-a", "127.0.0.1", "-p", str(port), "-sd", str(store)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"nats://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("nats-server did not start")


class EventsChain(peers.Fairshare):
    """The full chain with usage events on: the workers and a relay get FAIRSHARE_USAGE_NATS_URL."""

    def __init__(self, url: str):
        super().__init__("chain", "Fairshare, full chain, usage events on", "a metered TaskRun, slot, ledger charge")
        self.key = "fairshare-chain-events"
        self.url = url
        self.workers = "1 qcluster, 2 workers (ORM broker, poll 0.1 s) + 1 usage_relay"
        self.polls = 0
        self.lags: list[tuple[int, float]] = []

    def start(self, db_url: str, log_dir: Path) -> list:
        stream = self.stream = f"BENCH_{uuid.uuid4().hex[:8]}"
        env = h.cluster_env(workers=2, poll=0.1, DATABASE_URL=db_url, FAIRSHARE_USAGE_NATS_URL=self.url,
                            FAIRSHARE_USAGE_STREAM=stream, FAIRSHARE_USAGE_SUBJECT_PREFIX=stream.lower(),
                            FAIRSHARE_USAGE_MAX_BYTES=str(1024 ** 3))
        self.polls, self.lags = 0, []
        cluster = h.start_cluster(env, log_dir / f"{self.key}.log")
        relay = h.processes.Cluster("default", env, log_dir / "usage-relay.log", command="usage_relay")
        return [cluster, relay]

    def cleanup(self) -> None:
        """The round's stream goes: a stream reserves its FAIRSHARE_USAGE_MAX_BYTES on the server."""
        from usage.sinks import connect

        async def delete():
            nc = await connect(self.url)
            await nc.jetstream().delete_stream(self.stream)
            await nc.close()
        asyncio.run(delete())

    def remaining(self, count, n: int) -> int:
        self.polls += 1
        if self.polls % LAG_EVERY == 0:
            self.lags.append((count("SELECT count(*) FROM usage_usageevent"), count(
                "SELECT COALESCE(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float FROM usage_usageevent")))
        return super().remaining(count, n)


def bench_chain(args, url: str, log_dir: Path) -> dict:
    off, on = peers.SYSTEMS["fairshare-chain"], EventsChain(url)
    template = f"{DB_PREFIX}_tmpl_usage_log"
    h.log(f"template database {template}")
    off.setup(peers.create_database(template))
    h.at_exit(lambda: peers.drop_database(template))
    rounds = []
    for r in range(args.rounds):
        order = [off, on] if r % 2 == 0 else [on, off]
        result = {"order": [s.key for s in order]}
        for s in order:
            time.sleep(1.0)
            x = peers.measure(s, args.jobs, f"{DB_PREFIX}_{s.key.replace('-', '_')}", template, log_dir,
                              args.timeout)
            if s is on:
                x["relay_lag_events_max"] = max((e for e, _ in on.lags), default=0)
                x["relay_lag_s_max"] = max((sec for _, sec in on.lags), default=0.0)
                x["relay_lag_events_at_end"] = on.lags[-1][0] if on.lags else 0
            result[s.key] = x
            h.log(f"round {r + 1}: {s.key:24s} {x['jobs_per_s']:7.1f} jobs/s, "
                  f"{h.fmt(x['machine_cpu_s_per_1000'], '.2f')} machine / {x['own_cpu_s_per_1000']:.2f} own CPU s "
                  f"per 1,000" + (f", relay lag max {x['relay_lag_events_max']} events / {x['relay_lag_s_max']:.2f} s"
                                  if s is on else "") + f" (load {x['loadavg_1m_at_start']:.2f})")
        rounds.append(result)
    summary = {}
    for s in (off, on):
        xs = [r[s.key] for r in rounds]
        summary[s.key] = {k: h.median([x[k] for x in xs if x.get(k) is not None])
                          for k in ("jobs_per_s", "machine_cpu_s_per_1000", "own_cpu_s_per_1000",
                                    "database_cpu_s_per_1000", "wal_bytes_per_job")}
        summary[s.key]["jobs_per_s_rounds"] = [x["jobs_per_s"] for x in xs]
    summary[on.key]["relay_lag_events_max"] = max(r[on.key]["relay_lag_events_max"] for r in rounds)
    summary[on.key]["relay_lag_s_max"] = max(r[on.key]["relay_lag_s_max"] for r in rounds)
    # Per round (each pair ran back to back), then the median: the load moves between rounds.
    ratios = {k: h.median([r[on.key][k] / r[off.key][k] for r in rounds])
              for k in ("jobs_per_s", "machine_cpu_s_per_1000", "own_cpu_s_per_1000")}
    return {"systems": summary, "rounds": rounds, "ratios_on_over_off": ratios}


def bench_settlement(args) -> dict:
    from django.db import connection, transaction

    from budgets import clock, ledger
    from budgets.models import Account, Budget, UsageDay
    from scheduling import holding
    from scheduling.envelope import Envelope
    from scheduling.metering import Meter
    from scheduling.models import Outcome
    from scheduling.services import RunEnd, task_run_new
    from usage.conf import EVENTS_GUC

    account = Account.objects.create(slug=f"usage-bench-{uuid.uuid4().hex[:6]}", name="usage bench")
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10 ** 6, max_concurrent=10)
    day = clock.budget_day()
    UsageDay.objects.get_or_create(account=account, queue="default", day=day)
    meter = Meter(cpu_ms=1, wall_ms=2)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        schedstat = Path(f"/proc/{cursor.fetchone()[0]}/schedstat")

    def on_cpu_ns() -> int:
        """The backend's time on a CPU, in ns (not /proc/<pid>/stat's 10 ms ticks)."""
        return int(schedstat.read_text().split()[0])

    def settle_one(i: int) -> int:
        """A slot activated, then charged; the charge's (the settlement's) backend CPU in ns."""
        ref = f"t{i}"
        run = task_run_new(job="scheduling.noop", queue="default", account_id=account.pk, ref=ref)
        with transaction.atomic():
            ledger.lock(account_id=account.pk, queue="default")
            state = ledger.standing(account_id=account.pk, queue="default", day=day)
            slot = ledger.activate(envelope=Envelope(job="scheduling.noop", account=account.pk, ref=ref),
                                   queue="default", state=state, day=day, own=None, reserve_ms=10, run=run, worker="b")
        before = on_cpu_ns()
        ledger.charge(slot_id=slot, account_id=account.pk, queue="default", meter=meter, cap_hit=False,
                      end=RunEnd(meter=meter, outcome=Outcome.SUCCEEDED), now=holding.clock.now())
        return on_cpu_ns() - before

    per = {"off": [], "on": []}
    i = 0
    for _ in range(20):  # warm-up: plans made
        settle_one(i := i + 1)
    # Short alternating cycles, each settlement timed on its own: the medians hold where the load moves.
    for _ in range(args.cycles):
        for mode in ("off", "on"):
            with connection.cursor() as cursor:
                cursor.execute(f"SET {EVENTS_GUC} = %s", ["1" if mode == "on" else "0"])
                cursor.execute("DELETE FROM usage_usageevent")
            per[mode].extend(settle_one(i := i + 1) for _ in range(args.settlements))
    quartiles = {m: [round(q / 1000) for q in statistics.quantiles(v, n=4)] for m, v in per.items()}
    h.log(f"settlement: backend CPU quartiles off {quartiles['off']} us, on {quartiles['on']} us")
    return {"settlements_per_mode": len(per["on"]), "cycles": args.cycles,
            "backend_us_quartiles": quartiles, "loadavg_1m_end": os.getloadavg()[0]}


def fake_event(i: int) -> tuple[str, bytes, str]:
    account, queue, day = 1 + i % 50, ("default", "exports")[i % 2], f"2026-12-{1 + i % 7:02d}"
    ev = str(uuid.uuid4())
    body = {"v": 1, "id": ev, "type": "run.settled", "at": "2026-12-05T08:00:00.123456+00:00", "account": account,
            "queue": queue, "day": day, "run": i, "job": "scheduling.noop", "ref": f"peers-{i}",
            "outcome": "succeeded", "started_at": "2026-12-05T08:00:00.012345+00:00",
            "finished_at": "2026-12-05T08:00:00.123456+00:00", "cpu_ms": 3 + i % 5, "wall_ms": 7, "db_wait_ms": 1,
            "storage_wait_ms": 0, "items": 0, "charged": {"runs": 1, "cpu_ms": 3 + i % 5, "wall_ms": 7,
                                                         "db_wait_ms": 1, "storage_wait_ms": 0}}
    return ev, json.dumps(body).encode(), f"run.{queue}.{account}"


async def fill(url: str, n: int) -> float:
    """Publish n events as the relay would, but without waiting for each acknowledgement (core
    NATS publishes the stream captures, flushed every 2,000), then wait until the stream holds them."""
    from django.conf import settings

    from usage.sinks import connect, ensure_stream

    nc = await connect(url)
    js = nc.jetstream(timeout=30)
    await ensure_stream(js)
    prefix = settings.FAIRSHARE["USAGE_SUBJECT_PREFIX"]
    start = time.perf_counter()
    for first in range(0, n, 2000):
        for ev, payload, subject in (fake_event(i) for i in range(first, min(n, first + 2000))):
            await nc.publish(f"{prefix}.{subject}", payload, headers={"Nats-Msg-Id": ev})
        await nc.flush(timeout=30)
    while (await js.stream_info(settings.FAIRSHARE["USAGE_STREAM"])).state.messages < n:
        await asyncio.sleep(0.1)
    seconds = time.perf_counter() - start
    await nc.close()
    return seconds


def bench_replay(args, url: str) -> dict:
    import datetime as dt

    from django.conf import settings

    from usage import replay

    settings.FAIRSHARE["USAGE_STREAM"] = "BENCH_REPLAY"
    settings.FAIRSHARE["USAGE_SUBJECT_PREFIX"] = "bench.usage"
    settings.FAIRSHARE["USAGE_DUPLICATE_WINDOW_S"] = 10
    settings.FAIRSHARE["USAGE_MAX_BYTES"] = 4 * 1024 ** 3  # reserved on the server: the events' ~0.7 GB fit
    load_start = os.getloadavg()[0]
    h.log(f"replay: publishing {args.events} events")
    publish_s = asyncio.run(fill(url, args.events))
    h.log(f"replay: published in {publish_s:.1f} s; reading them back")
    cpu0, start = time.process_time(), time.perf_counter()
    rebuilt = replay.rebuild(replay.read_stream(url, replay.Start()), first_day=dt.date(2026, 12, 1),
                             last_day=dt.date(2026, 12, 31))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    if rebuilt.events != args.events:
        raise RuntimeError(f"read {rebuilt.events} of {args.events} events")
    return {"events": args.events, "publish_s": publish_s, "publish_per_s": args.events / publish_s,
            "replay_s": seconds, "replay_events_per_s": args.events / seconds, "replay_cpu_s": cpu,
            "account_queue_days": len(rebuilt.totals), "loadavg_1m_at_start": load_start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2000, help="jobs per system and round (default 2000)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, events off and on in each (default 3)")
    p.add_argument("--events", type=int, default=1_000_000, help="events the replay reads back (default 1,000,000)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a drain may take before the run fails")
    p.add_argument("--settlements", type=int, default=300, help="settlements per cycle and way (default 300)")
    p.add_argument("--cycles", type=int, default=10, help="cycles of the settlement alone (default 10)")
    p.add_argument("--skip-chain", action="store_true", help="the settlement alone and the replay only")
    p.add_argument("--skip-settlement", action="store_true")
    p.add_argument("--skip-replay", action="store_true", help="the chain only")
    p.add_argument("--json", type=Path, default=h.RESULTS_DIR / "usage_log.json")
    args = p.parse_args(argv)
    # Django on a database of its own (the settlement's part writes there); the chain's rounds make theirs.
    h.prepare(f"{DB_PREFIX}_settlement", fresh=True, drop=True, test_jobs=False)
    info = h.machine_info(peers.server_url("postgres"))
    store = Path(tempfile.mkdtemp(prefix="fairshare-bench-nats-"))
    h.at_exit(lambda: shutil.rmtree(store, ignore_errors=True))
    nats, url = start_nats(store)
    h.at_exit(lambda: (nats.kill(), nats.wait(10)))
    log_dir = Path(tempfile.mkdtemp(prefix="fairshare-usage-log-"))
    h.at_exit(lambda: shutil.rmtree(log_dir, ignore_errors=True))
    results = {"benchmark": "usage_log", "timestamp": h.utc_timestamp(), "machine": info,
               "parameters": {"jobs": args.jobs, "rounds": args.rounds, "events": args.events}}
    if not args.skip_chain:
        results["chain"] = bench_chain(args, url, log_dir)
    if not args.skip_settlement:
        results["settlement"] = bench_settlement(args)
    if not args.skip_replay:
        results["replay"] = bench_replay(args, url)
    info["loadavg_end"] = list(os.getloadavg())
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    results["uptime_end"] = uptime

    print()
    if "chain" in results:
        c = results["chain"]
        rows = [[key, h.fmt(x["jobs_per_s"], ".0f"), " / ".join(f"{v:.0f}" for v in x["jobs_per_s_rounds"]),
                 h.fmt(x["machine_cpu_s_per_1000"], ".2f"), h.fmt(x["own_cpu_s_per_1000"], ".2f"),
                 h.fmt(x.get("relay_lag_events_max"), ".0f") if "relay_lag_events_max" in x else "-",
                 h.fmt(x.get("relay_lag_s_max"), ".2f") if "relay_lag_s_max" in x else "-"]
                for key, x in c["systems"].items()]
        print(h.render_table(["system", "jobs/s (median)", "rounds", "machine CPU s per 1,000 jobs",
                              "its processes' CPU s", "relay lag max (events)", "relay lag max (s)"],
                             rows, right={1, 2, 3, 4, 5, 6}))
        r = c["ratios_on_over_off"]
        print(f"\non/off (median of per-round ratios): jobs/s {r['jobs_per_s']:.3f}x, machine CPU per job "
              f"{r['machine_cpu_s_per_1000']:.3f}x, own CPU per job {r['own_cpu_s_per_1000']:.3f}x")
        print(f"{'PASS' if r['jobs_per_s'] >= 0.9 else 'MISS'}  events on keep >= 0.90x jobs/s")
        print(f"{'PASS' if r['own_cpu_s_per_1000'] <= 1.1 else 'MISS'}  events on cost <= 1.10x CPU per job "
              "(its processes')")
    if "settlement" in results:
        q = results["settlement"]["backend_us_quartiles"]
        print(f"\nsettlement: its PostgreSQL backend's CPU, quartiles of {results['settlement']['settlements_per_mode']:,}"
              f" each way: off {' / '.join(map(str, q['off']))} us, on {' / '.join(map(str, q['on']))} us "
              f"(median +{q['on'][1] - q['off'][1]} us)")
    if "replay" in results:
        x = results["replay"]
        print(f"\nreplay: {x['events']:,} events read back and summed in {x['replay_s']:.1f} s = "
              f"{x['replay_events_per_s']:,.0f} events/s ({x['replay_cpu_s']:.1f} CPU s; published at "
              f"{x['publish_per_s']:,.0f}/s)")
    print(uptime)
    h.print_load(results)
    h.write_results(args.json, results)
    return 0


if __name__ == "__main__":
    h.run(main)
