"""Run every round of a plan, compare them with the stop rule, and report (a table, JSON)."""
import math
import os
import signal
import tempfile
import threading
import uuid
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

from django.conf import settings
from django.db import connection
from django.utils import timezone

from exports.rehearsal.plan import (
    ACCOUNT_SLUG, DEFAULT_QUEUE_WORKERS, EXPORT_SPANS_DAYS, RehearsalPlan, ensure_account,
)
from exports.rehearsal.round import RoundResult, run_round
from scheduling.reporting import render_table

# The stop rule's threshold: a step that adds less throughput than this is not worth its cost.
MIN_GAIN = 0.10


@dataclass
class Recommendation:
    concurrency: int
    memory_budget_mib: int          # peak RSS per active export x concurrency
    peak_rss_per_export_mib: float
    stopped: bool                   # whether the stop rule fired
    stopped_between: list[int] | None
    reason: str


def recommend(rounds: list[RoundResult]) -> Recommendation:
    """Apply the stop rule, then choose the smallest concurrency that gets (within 10%) the best
    throughput seen before the rule fired: more workers that add little only cost memory and
    database connections."""
    ordered = sorted(rounds, key=lambda r: r.concurrency)
    considered, stopped_between, notes = [ordered[0]], None, []
    for prev, nxt in pairwise(ordered):
        gain = (nxt.exports_per_minute / prev.exports_per_minute - 1) if prev.exports_per_minute else math.inf
        if gain < MIN_GAIN and nxt.db_wait_share > prev.db_wait_share:
            stopped_between = [prev.concurrency, nxt.concurrency]
            notes.append(
                f"fired from {prev.concurrency} to {nxt.concurrency} workers: throughput {gain:+.1%} "
                f"(< {MIN_GAIN:.0%}) while the DB-wait share grew {prev.db_wait_share:.0%} -> {nxt.db_wait_share:.0%}")
            break
        considered.append(nxt)
    if stopped_between is None:
        notes.append("did not fire within the tried concurrencies")
    healthy = [r for r in considered if not r.errors and not r.timed_out] or considered
    best = max(r.exports_per_minute for r in healthy)
    chosen = min((r for r in healthy if r.exports_per_minute >= (1 - MIN_GAIN) * best), key=lambda r: r.concurrency)
    notes.append(f"{chosen.concurrency} is the smallest concurrency within {MIN_GAIN:.0%} of the best throughput "
                 f"({best:.1f} exports/min)" + ("" if healthy == considered else " among error-free rounds"))
    return Recommendation(
        concurrency=chosen.concurrency,
        memory_budget_mib=math.ceil(chosen.peak_rss_mib * chosen.concurrency),
        peak_rss_per_export_mib=chosen.peak_rss_mib,
        stopped=stopped_between is not None, stopped_between=stopped_between,
        reason="; ".join(notes),
    )


COLUMNS = [
    ("workers", lambda r: f"{r.concurrency}"),
    ("exports ok", lambda r: f"{r.exports_succeeded}/{r.exports_requested}"),
    ("exp/min", lambda r: f"{r.exports_per_minute:.1f}"),
    ("makespan s", lambda r: f"{r.makespan_s:.1f}"),
    ("oldest wait s", lambda r: f"{r.oldest_job_age_s:.1f}"),
    ("p95 s", lambda r: f"{r.p95_latency_s:.2f}"),
    ("p95 export s", lambda r: f"{r.p95_export_latency_s:.1f}"),
    ("p95 small s", lambda r: f"{r.p95_small_job_latency_s:.2f}"),
    ("errors", lambda r: f"{r.errors}"),
    ("cpu %", lambda r: f"{r.cpu_share:.0%}"),
    ("db wait %", lambda r: f"{r.db_wait_share:.0%}"),
    ("storage %", lambda r: f"{r.storage_wait_share:.0%}"),
    ("other %", lambda r: f"{r.other_share:.0%}"),
    ("peak RSS MiB", lambda r: f"{r.peak_rss_mib:.0f}"),
    ("load 1m", lambda r: f"{r.load_before:.1f}->{r.load_after:.1f}"),
    ("db conns", lambda r: f"{r.peak_db_connections}"),
]


def table(rounds: list[RoundResult]) -> str:
    return render_table([title for title, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in rounds],
                        right=range(len(COLUMNS)))


def _interrupted(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def rehearse(plan: RehearsalPlan, *, say=print) -> dict:
    """Run every round of `plan`, compare them and return the report (also what goes to JSON)."""
    # SIGTERM, like Ctrl-C, unwinds through each round's `finally`, which stops its clusters.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupted) if in_main_thread else None
    try:
        return _rehearse(plan, say=say)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def _rehearse(plan: RehearsalPlan, *, say) -> dict:
    account, user = ensure_account(rows=plan.rows, max_concurrency=max(plan.concurrencies))
    run_id = uuid.uuid4().hex[:8]
    log_dir = Path(tempfile.mkdtemp(prefix=f"fairshare-rehearsal-{run_id}-"))
    say(f"Rehearsal {run_id}: {plan.exports} exports + {plan.small_jobs} small jobs over {plan.rows} rows, "
        f"export workers {', '.join(map(str, plan.concurrencies))} (worker logs in {log_dir})")
    rounds = []
    for concurrency in plan.concurrencies:
        result = run_round(account=account, user=user, plan=plan, concurrency=concurrency, run_id=run_id,
                           log_dir=log_dir, say=say)
        say(f"  concurrency {concurrency}: {result.exports_succeeded}/{result.exports_requested} exports in "
            f"{result.makespan_s:.1f} s, {result.errors} errors" + (" (TIMED OUT)" if result.timed_out else ""))
        rounds.append(result)
    return _report(plan, run_id, rounds)


def _report(plan: RehearsalPlan, run_id: str, rounds: list[RoundResult]) -> dict:
    db = connection.settings_dict
    return {
        "run_id": run_id,
        "finished_at": timezone.now().isoformat(),
        "plan": {**asdict(plan), "concurrencies": list(plan.concurrencies),
                 "default_queue_workers": DEFAULT_QUEUE_WORKERS,
                 "account": ACCOUNT_SLUG, "export_spans_days": list(EXPORT_SPANS_DAYS), "min_gain": MIN_GAIN},
        # Where it ran, without credentials.
        "host": {"cpus": os.cpu_count(), "database": f"{db['HOST'] or 'localhost'}/{db['NAME']}",
                 "broker": "redis" if "redis" in settings.Q_CLUSTER else "orm"},
        "rounds": [asdict(r) for r in rounds],
        "table": table(rounds),
        "recommendation": asdict(recommend(rounds)),
    }
