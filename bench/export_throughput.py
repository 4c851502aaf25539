#!/usr/bin/env python
"""Export throughput and worker memory on PostgreSQL, beside PostgreSQL's own COPY.

    .venv/bin/python bench/export_throughput.py                 # 100,000 and 1,000,000 rows
    .venv/bin/python bench/export_throughput.py --quick         # 20,000 and 100,000 rows (smoke run)
    .venv/bin/python bench/export_throughput.py --rows 500000 --small 50000 --repeat 5

For each size it measures, `--repeat` times (median reported):
- the baseline: `psql -c "COPY (<the job's own SELECT>) TO STDOUT (FORMAT csv, FORCE_QUOTE *)"`
  written to a file, the statement built from `exports.streaming.copy_statement` and the
  `activity` source's queryset (parameters inlined with psycopg's `ClientCursor.mogrify`), so it
  cannot drift from what the job runs;
- a full export through the real job: `exports.requests.export_request`, processed by a real
  `manage.py qcluster` (queue "exports", one worker); enqueue -> succeeded from the export's own
  timestamps, the in-worker wall time and the worker's peak RSS from its TaskRun;
- `exports.streaming.stream_csv` for each read strategy ("copy", "cursor", "orm"), each run in a
  fresh child process writing to a temporary file, without the broker.

It prints a table, checks the goals (job >= 0.8x COPY's throughput at the full size; worker peak
RSS at the full size <= 1.2x that at the small size) and writes JSON to bench/results/.

The benchmark owns its database (default `fairshare_bench` on the server of DATABASE_URL, or
BENCH_DATABASE_URL verbatim); it never writes to the database DATABASE_URL names. The data set is
reused between runs when it is already there (`--fresh` rebuilds it, `--drop` drops the database
at the end).
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `bench.harness`
from bench import harness as h  # noqa: E402  (shared plumbing)
from bench.harness import (  # noqa: E402
    REPO, RESULTS_DIR, Cluster, fmt, log, machine_info, median, redact_url, setup_django,
)

DEFAULT_DB_NAME = "fairshare_bench"

# The exported scope: 90 whole UTC days, the span the generated activity is spread over.
EXPORT_START = dt.date(2026, 1, 1)
EXPORT_END = dt.date(2026, 3, 31)
SPAN_SECONDS = 90 * 86400
DATA_VERSION = 2  # bump when the generated rows change, so old data sets are rebuilt (2: sample_data)
NOISE_SHARE = 4  # each size's account gets a neighbour account with 1/NOISE_SHARE as many rows

THROUGHPUT_GOAL = 0.95  # the job's throughput relative to COPY's, at the full size (issue 10; was 0.8)
RSS_GOAL = 1.2  # worker peak RSS at the full size relative to the small size
CPU_GOAL_S = 1.2  # the worker's CPU seconds per 1,000,000 rows, at the full size (issue 10)

STRATEGIES = ("copy", "cursor", "orm")

JOB_TIMEOUT_S = 1800
PSQL_TIMEOUT_S = 900
CHILD_TIMEOUT_S = 1800


# --- Processes -------------------------------------------------------------------------------------

def run_with_rusage(cmd: list[str], *, stdout, env: dict[str, str], timeout: float) -> tuple[float, float, bytes]:
    """Run `cmd`, returning (wall seconds, the child's CPU seconds, stderr). Raises on failure.

    (Not its peak RSS: ru_maxrss of a child forked from this process counts this process's pages
    from before the exec.)
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        stderr = proc.stderr.read()
        _, status, usage = os.wait4(proc.pid, 0)
    except BaseException:
        proc.kill()  # interrupted (Ctrl-C, SIGTERM): don't leave it running
        proc.wait(5)
        raise
    finally:
        timer.cancel()
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr.close()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}: {stderr.decode(errors='replace')[-2000:]}")
    return seconds, usage.ru_utime + usage.ru_stime, stderr


# --- The data set -----------------------------------------------------------------------------------

def generate(account, rows: int, neighbour, noise: int) -> None:
    """`rows` realistic rows of the account (exports.sample_data, seeded by its slug) interleaved in
    time, and so on disk, with `noise` rows of its neighbour: the account filter matters and the
    heap is shared. One COPY, in time order."""
    import heapq

    from django.db import connection

    from exports.sample_data import activity_rows, insert_activity

    since = dt.datetime.combine(EXPORT_START, dt.time.min, tzinfo=dt.UTC)
    series = [activity_rows(account_id=a.pk, count=n, since=since, span_s=SPAN_SECONDS, seed=a.slug)
              for a, n in ((account, rows), (neighbour, noise))]
    with connection.cursor() as cur:
        cur.execute("DELETE FROM exports_activityevent WHERE account_id IN (%s, %s)", [account.pk, neighbour.pk])
    insert_activity(heapq.merge(*series, key=lambda row: row[1]))


def account_slug(rows: int) -> str:
    return f"bench-{rows}"


def ensure_dataset(sizes: list[int]) -> dict[int, dict]:
    """One account per size with exactly that many rows (plus a neighbour); reused when present."""
    from django.contrib.auth import get_user_model
    from django.db import connection

    from budgets.models import Account, Membership, Plan, Role
    from exports.models import ActivityEvent

    user, _ = get_user_model().objects.get_or_create(
        username="bench", defaults={"is_superuser": True, "is_staff": True, "email": "bench@example.com"},
    )
    accounts = {}
    inserted = False
    for rows in sizes:
        marker = f"Benchmark data v{DATA_VERSION}: {rows} rows"
        account, _ = Account.objects.get_or_create(slug=account_slug(rows), defaults={"name": marker, "plan": Plan.ENTERPRISE})
        neighbour, _ = Account.objects.get_or_create(
            slug=f"{account_slug(rows)}-neighbour", defaults={"name": marker, "plan": Plan.ENTERPRISE},
        )
        Membership.objects.get_or_create(user=user, account=account, defaults={"role": Role.OWNER})
        noise = max(1, rows // NOISE_SHARE)
        have = ActivityEvent.objects.filter(account=account).count()
        have_noise = ActivityEvent.objects.filter(account=neighbour).count()
        if (have, have_noise, account.name, neighbour.name) != (rows, noise, marker, marker):
            log(f"generating {rows:,} activity rows (+{noise:,} for a neighbour account)")
            t0 = time.perf_counter()
            generate(account, rows, neighbour, noise)
            Account.objects.filter(pk__in=[account.pk, neighbour.pk]).update(name=marker)
            log(f"  inserted in {time.perf_counter() - t0:.1f}s")
            inserted = True
        accounts[rows] = {"slug": account.slug, "account_id": account.pk, "neighbour_rows": noise}
    # Django runs in autocommit, so VACUUM (which refuses a transaction block) can go through it.
    with connection.cursor() as cur:
        if inserted:
            # Statistics, hint bits and the visibility map now, so no measured run pays for them; and
            # a checkpoint, so the flush of the fresh pages does not land inside a measurement.
            log("VACUUM (ANALYZE) + CHECKPOINT")
            cur.execute("VACUUM (ANALYZE) exports_activityevent")
            cur.execute("CHECKPOINT")
        else:
            cur.execute("ANALYZE exports_activityevent")
    return accounts


def reset_bench_records() -> None:
    """Forget exports, runs and queued messages of earlier benchmark runs (the database is ours)."""
    from django.apps import apps

    # By label, so a model that does not exist (yet) in this version is simply skipped.
    for label in ("exports.ExportRecord", "scheduling.TaskRun", "scheduling.DeferredTask", "django_q.OrmQ", "django_q.Task"):
        try:
            model = apps.get_model(label)
        except LookupError:
            continue
        model.objects.all().delete()


# --- The statement the job runs -----------------------------------------------------------------

def export_bounds():
    from exports.sources import day_bounds

    return day_bounds(EXPORT_START, EXPORT_END)


def job_copy_sql(account_id: int) -> str:
    """The exact COPY statement the job's "copy" strategy sends, with its parameters inlined."""
    from django.db import connection
    from psycopg import ClientCursor

    from exports.sources import get_source
    from exports.streaming import copy_statement

    source = get_source("activity")
    since, until = export_bounds()
    statement, params = copy_statement(source, source.queryset(account_id=account_id, since=since, until=until))
    connection.ensure_connection()
    # Django's own psycopg connection: the same adapters (and so the same literals) as the job.
    return ClientCursor(connection.connection).mogrify(statement, params)


def csv_header_bytes() -> bytes:
    from exports.sources import get_source
    from exports.streaming import line_renderer

    return line_renderer()([get_source("activity").header])


def sha256_of(path: Path, *, prefix: bytes = b"") -> str:
    digest = hashlib.sha256(prefix)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- Measurements ---------------------------------------------------------------------------------

PSQL_ENV = {"PGTZ": "UTC", "PGCLIENTENCODING": "UTF8"}


def measure_psql_copy(db_url: str, copy_sql: str, out_path: Path) -> dict:
    """psql runs the job's COPY and writes the CSV to a file (like the job writes its temp file)."""
    cmd = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db_url, "-c", copy_sql]
    with open(out_path, "wb") as out:
        seconds, cpu_s, _ = run_with_rusage(cmd, stdout=out, env={**os.environ, **PSQL_ENV}, timeout=PSQL_TIMEOUT_S)
    return {"seconds": seconds, "bytes": out_path.stat().st_size, "cpu_s": cpu_s}


def measure_server_only(db_url: str, copy_sql: str, nbytes: int) -> dict | None:
    """The server alone: the same COPY into the server's /dev/null, no client reading it.

    Needs a superuser or pg_write_server_files; None when not allowed.
    """
    statement = copy_sql.replace("TO STDOUT", "TO '/dev/null'", 1)
    cmd = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", db_url, "-c", statement]
    try:
        seconds, cpu_s, _ = run_with_rusage(cmd, stdout=subprocess.DEVNULL, env={**os.environ, **PSQL_ENV},
                                            timeout=PSQL_TIMEOUT_S)
    except RuntimeError as exc:
        log(f"server-only COPY skipped: {str(exc).strip().splitlines()[-1]}")
        return None
    return {"seconds": seconds, "bytes": nbytes, "cpu_s": None}


def count_csv_records(path: Path) -> int:
    """Rows in a CSV file (quoted newlines included), for the baseline's row count."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        return sum(1 for _ in csv.reader(f))


def measure_job(*, cluster: Cluster, slug: str, user, start: dt.date, end: dt.date, export_root: Path) -> dict:
    from exports.models import ExportRecord, ExportStatus
    from exports.requests import export_request
    from scheduling.models import TaskRun

    t0 = time.perf_counter()
    record, _ = export_request(account_slug=slug, user=user, start=start, end=end)
    deadline = t0 + JOB_TIMEOUT_S
    while True:
        status = ExportRecord.objects.filter(pk=record.pk).values_list("status", flat=True).get()
        if status in (ExportStatus.SUCCEEDED, ExportStatus.FAILED, ExportStatus.CANCELLED):
            break
        if not cluster.alive():
            raise RuntimeError(f"the qcluster exited ({cluster.returncode}):\n{cluster.tail(40)}")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"export {record.pk} not finished after {JOB_TIMEOUT_S}s:\n{cluster.tail(40)}")
        time.sleep(0.02)
    observed_s = time.perf_counter() - t0
    record.refresh_from_db()
    if record.status != ExportStatus.SUCCEEDED:
        raise RuntimeError(f"export {record.pk} {record.status}: {record.error_class}: {record.error_message}")
    # The record completes inside the run; the TaskRun is finished (metered) just after it.
    while True:
        runs = list(TaskRun.objects.filter(job="exports.build", ref=str(record.pk)).order_by("started_at"))
        run = next((r for r in reversed(runs) if r.outcome == "succeeded"), None)
        if run is not None:
            break
        if time.perf_counter() > deadline or not cluster.alive():
            raise RuntimeError(f"no finished TaskRun for export {record.pk}:\n{cluster.tail(40)}")
        time.sleep(0.02)
    worker_pid = int(run.worker.rsplit(":", 1)[-1]) if ":" in run.worker else None
    published = export_root / record.output_key
    result = {
        "export_id": str(record.pk),
        "rows": record.row_count,
        "bytes": record.byte_size,
        "sha256": record.checksum_sha256,
        # enqueue -> succeeded, from the record's own timestamps (created in the request's
        # transaction; completed by the fenced completion in the worker).
        "seconds": (record.completed_at - record.created_at).total_seconds(),
        "queue_wait_s": (record.started_at - record.created_at).total_seconds(),
        "observed_s": observed_s,  # as seen by this process's 20 ms polling
        "worker_wall_s": run.wall_ms / 1000,
        "worker_cpu_s": run.cpu_ms / 1000,
        "db_wait_s": run.db_wait_ms / 1000,
        "storage_wait_s": run.storage_wait_ms / 1000,
        "peak_rss_kb": run.peak_rss_kb,
        "task_runs": len(runs),
        "attempts": record.attempt_count,
        "worker_pid": worker_pid,
    }
    if published.exists():
        published.unlink()  # keep the disk footprint to one file at a time
    return result


def measure_in_process(*, strategy: str, account_id: int, tmp_dir: Path, env: dict[str, str]) -> dict:
    """stream_csv with one strategy, in a fresh child process (so its peak RSS is its own)."""
    cmd = [
        sys.executable, str(Path(__file__).resolve()), "--child-stream", strategy,
        "--child-account", str(account_id), "--child-tmp", str(tmp_dir),
    ]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"stream_csv child ({strategy}) failed:\n{done.stderr.decode(errors='replace')[-3000:]}")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def child_stream(strategy: str, account_id: int, tmp_dir: Path) -> None:
    """Child process: one metered stream_csv run into a temporary file; prints JSON."""
    setup_django()
    from scheduling.metering import Meter
    from exports.sources import get_source
    from exports.streaming import stream_csv

    since, until = export_bounds()
    meter = Meter()
    with tempfile.TemporaryFile(prefix="fairshare-bench-", dir=tmp_dir) as out, meter.measure():
        t0 = time.perf_counter()
        result = stream_csv(
            source=get_source("activity"), account_id=account_id, since=since, until=until,
            out=out, meter=meter, strategy=strategy,
        )
        out.flush()
        seconds = time.perf_counter() - t0
    print(json.dumps({
        "strategy": strategy, "seconds": seconds, "rows": result.rows, "bytes": result.byte_size,
        "sha256": result.sha256, "cpu_s": meter.cpu_ms / 1000, "db_wait_s": meter.db_wait_ms / 1000,
        "peak_rss_kb": meter.peak_rss_kb,
    }))


# --- Reporting --------------------------------------------------------------------------------------

def summarise(path_runs: list[dict], *, rows: int, key: str = "seconds") -> dict:
    seconds = median([r[key] for r in path_runs])
    nbytes = median([r["bytes"] for r in path_runs])
    rss = median([r.get("peak_rss_kb") for r in path_runs])
    return {
        "seconds": seconds,
        "rows_per_s": rows / seconds if seconds else None,
        "mb_per_s": nbytes / seconds / 1e6 if seconds else None,
        "bytes": nbytes,
        "peak_rss_kb": rss,
        "repeats": [r[key] for r in path_runs],
    }


def wait_for_quiet(max_seconds: float) -> None:
    limit = 0.5 * (os.cpu_count() or 1)
    deadline = time.monotonic() + max_seconds
    while (load := os.getloadavg()[0]) >= limit and time.monotonic() < deadline:
        log(f"load average {load:.2f} >= {limit:.1f}; waiting for a quieter machine")
        time.sleep(15)


def results_table(results: dict) -> str:
    headers = ["rows", "path", "seconds", "rows/s", "MB/s", "x COPY", "peak RSS MiB", "client CPU s"]
    lines = []
    for size_key, size in results["sizes"].items():
        base = size["paths"]["psql_copy"]["seconds"]
        for name, label in PATH_LABELS:
            path = size["paths"].get(name)
            if path is None:
                continue
            ratio = base / path["seconds"] if base and path["seconds"] else None
            rss = path.get("peak_rss_kb")
            lines.append([
                f"{int(size_key):,}", label, fmt(path["seconds"], ".2f"), fmt(path["rows_per_s"], ",.0f"),
                fmt(path["mb_per_s"], ".1f"), fmt(ratio, ".2f"), fmt(rss / 1024 if rss else None, ".1f"),
                fmt(path.get("cpu_s"), ".2f"),
            ])
        lines.append(None)
    return h.render_table(headers, lines[:-1], right={0, 2, 3, 4, 5, 6, 7})


PATH_LABELS = [
    ("psql_copy", "psql COPY -> file (baseline)"),
    ("server_only", "server COPY -> /dev/null"),
    ("job", "job: enqueue -> succeeded"),
    ("job_in_worker", "job: in-worker wall"),
    ("stream_copy", "stream_csv copy"),
    ("stream_cursor", "stream_csv cursor"),
    ("stream_orm", "stream_csv orm"),
]


# --- Main ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000, help="the full size (default 1,000,000)")
    parser.add_argument("--small", type=int, default=100_000, help="the small size (default 100,000)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20,000 and 100,000 rows, one repeat")
    parser.add_argument("--repeat", type=int, help="measurements per path and size, median reported (default 3; 1 with --quick)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="stream_csv strategies to measure in-process ('' for none)")
    parser.add_argument("--no-job", action="store_true", help="skip the qcluster job measurement")
    parser.add_argument("--no-server-only", action="store_true",
                        help="skip the server-only COPY (to the server's /dev/null, needs superuser)")
    parser.add_argument("--db-name", default=DEFAULT_DB_NAME, help="the benchmark's database on DATABASE_URL's server")
    parser.add_argument("--fresh", action="store_true", help="drop and rebuild the benchmark database first")
    parser.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    parser.add_argument("--wait-for-quiet", type=float, default=0, metavar="SECONDS",
                        help="before measuring, wait up to SECONDS for the 1-minute load average to drop below "
                             "half the CPU count (for shared machines)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed (not only on wrong output)")
    parser.add_argument("--json", type=Path, help="where to write the results (default bench/results/export_throughput[-quick].json)")
    # Internal: one in-process stream_csv run (used by the benchmark itself).
    parser.add_argument("--child-stream", choices=STRATEGIES, help=argparse.SUPPRESS)
    parser.add_argument("--child-account", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-tmp", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.small, args.rows = 20_000, 100_000
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if not 0 < args.small < args.rows:
        parser.error("need 0 < --small < --rows")
    args.strategies = [s for s in args.strategies.split(",") if s]
    for s in args.strategies:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}; choose from {STRATEGIES}")
    if args.json is None:
        args.json = RESULTS_DIR / ("export_throughput-quick.json" if args.quick else "export_throughput.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child_stream:
        child_stream(args.child_stream, args.child_account, args.child_tmp)
        return 0

    db_url = h.prepare(args.db_name, fresh=args.fresh, drop=args.drop, test_jobs=False)
    env = dict(os.environ)
    sizes = [args.small, args.rows]
    log(f"database {redact_url(db_url)}; sizes {sizes[0]:,} and {sizes[1]:,}; {args.repeat} repeats")
    from django.contrib.auth import get_user_model

    accounts = ensure_dataset(sizes)
    reset_bench_records()
    user = get_user_model().objects.get(username="bench")
    if args.wait_for_quiet > 0:
        wait_for_quiet(args.wait_for_quiet)
    info = machine_info(db_url, pg_settings=("shared_buffers", "work_mem", "max_parallel_workers_per_gather", "jit"))
    info["psql"] = subprocess.run(["psql", "--version"], capture_output=True, text=True).stdout.strip()
    header = csv_header_bytes()

    tmp = tempfile.TemporaryDirectory(prefix="fairshare-bench-")
    h.at_exit(tmp.cleanup)
    tmp_dir = Path(tmp.name)
    export_root = tmp_dir / "exports"
    export_root.mkdir()

    cluster = None
    if not args.no_job:
        cluster_env = h.cluster_env(poll=0.1, FAIRSHARE_EXPORTS_ROOT=str(export_root), FAIRSHARE_EXPORT_WORKERS="1")
        log("starting qcluster (queue exports, 1 worker)")
        cluster = h.start_cluster(cluster_env, tmp_dir / "qcluster-exports.log", queue="exports")
        # Warm-up and readiness: one small export (one day of the small account), not measured.
        warm = measure_job(cluster=cluster, slug=accounts[args.small]["slug"], user=user,
                           start=EXPORT_START, end=EXPORT_START, export_root=export_root)
        log(f"worker ready (pid {warm['worker_pid']}); warm-up export took {warm['seconds']:.2f}s")

    results = {
        "benchmark": "export_throughput",
        "timestamp": h.utc_timestamp(),
        "parameters": {
            "rows": args.rows, "small": args.small, "quick": args.quick, "repeat": args.repeat,
            "strategies": args.strategies, "job": not args.no_job, "scope": [EXPORT_START.isoformat(), EXPORT_END.isoformat()],
            "source": "activity", "batch_rows": None, "poll_s": 0.1, "export_workers": 1,
            "baseline": "psql -c \"COPY (<job SELECT>) TO STDOUT (FORMAT csv, FORCE_QUOTE *)\" > file in the temp dir",
            "mb": "10^6 bytes",
        },
        "machine": info,
        "goals": {},
        "sizes": {},
    }
    from django.conf import settings

    results["parameters"]["batch_rows"] = settings.FAIRSHARE["EXPORT_BATCH_ROWS"]

    try:
        for rows in sizes:
            acct = accounts[rows]
            copy_sql = job_copy_sql(acct["account_id"])
            baseline_file = tmp_dir / f"copy-{rows}.csv"
            log(f"{rows:,} rows: warm-up COPY")
            measure_psql_copy(db_url, copy_sql, baseline_file)  # warm the caches; not measured
            raw: dict[str, list[dict]] = {"psql_copy": [], "server_only": [], "job": []}
            raw.update({f"stream_{s}": [] for s in args.strategies})
            server_only = not args.no_server_only
            for i in range(args.repeat):
                r = measure_psql_copy(db_url, copy_sql, baseline_file)
                raw["psql_copy"].append(r)
                log(f"{rows:,} rows #{i + 1}: psql COPY {r['seconds']:.2f}s (psql CPU {r['cpu_s']:.2f}s)")
                if server_only:
                    r = measure_server_only(db_url, copy_sql, raw["psql_copy"][-1]["bytes"])
                    if r is None:
                        server_only = False
                    else:
                        raw["server_only"].append(r)
                        log(f"{rows:,} rows #{i + 1}: server-only COPY {r['seconds']:.2f}s")
                if cluster is not None:
                    j = measure_job(cluster=cluster, slug=acct["slug"], user=user, start=EXPORT_START,
                                    end=EXPORT_END, export_root=export_root)
                    raw["job"].append(j)
                    log(f"{rows:,} rows #{i + 1}: job {j['seconds']:.2f}s (in worker {j['worker_wall_s']:.2f}s, "
                        f"peak RSS {j['peak_rss_kb'] / 1024:.1f} MiB)")
                for s in args.strategies:
                    c = measure_in_process(strategy=s, account_id=acct["account_id"], tmp_dir=tmp_dir, env=env)
                    raw[f"stream_{s}"].append(c)
                    log(f"{rows:,} rows #{i + 1}: stream_csv {s} {c['seconds']:.2f}s")

            # Correctness: every path wrote the same bytes (the baseline plus the header line).
            baseline_rows = count_csv_records(baseline_file)
            baseline_sha = sha256_of(baseline_file, prefix=header)
            baseline_file.unlink()
            digests = {"psql_copy (with header)": baseline_sha}
            produced = {name: runs for name, runs in raw.items() if name not in ("psql_copy", "server_only")}
            for name, runs in produced.items():
                for k, run in enumerate(runs):
                    digests[f"{name}#{k + 1}"] = run["sha256"]
            identical = len(set(digests.values())) == 1
            if not identical:
                log(f"WARNING: outputs differ between paths: {digests}")
            row_counts = {name: sorted({r["rows"] for r in runs}) for name, runs in produced.items()}
            if any(counts != [rows] for counts in row_counts.values()) or baseline_rows != rows:
                log(f"WARNING: row counts differ from {rows}: {row_counts}, COPY {baseline_rows}")

            paths = {"psql_copy": summarise(raw["psql_copy"], rows=rows)}
            paths["psql_copy"]["cpu_s"] = median([r["cpu_s"] for r in raw["psql_copy"]])
            paths["psql_copy"]["cpu_note"] = "psql client process (user + system)"
            if raw.get("server_only"):
                paths["server_only"] = summarise(raw["server_only"], rows=rows)
            if raw["job"]:
                paths["job"] = summarise(raw["job"], rows=rows)
                paths["job"]["cpu_s"] = median([r["worker_cpu_s"] for r in raw["job"]])
                paths["job"]["queue_wait_s"] = median([r["queue_wait_s"] for r in raw["job"]])
                paths["job"]["observed_s"] = median([r["observed_s"] for r in raw["job"]])
                paths["job_in_worker"] = summarise(raw["job"], rows=rows, key="worker_wall_s")
                paths["job_in_worker"]["cpu_s"] = paths["job"]["cpu_s"]
                paths["job_in_worker"]["db_wait_s"] = median([r["db_wait_s"] for r in raw["job"]])
                paths["job_in_worker"]["storage_wait_s"] = median([r["storage_wait_s"] for r in raw["job"]])
            for s in args.strategies:
                p = summarise(raw[f"stream_{s}"], rows=rows)
                p["cpu_s"] = median([r["cpu_s"] for r in raw[f"stream_{s}"]])
                p["db_wait_s"] = median([r["db_wait_s"] for r in raw[f"stream_{s}"]])
                paths[f"stream_{s}"] = p
            base = paths["psql_copy"]["seconds"]
            for p in paths.values():
                p["ratio_vs_copy"] = base / p["seconds"] if p["seconds"] else None
            # Each repeat runs the paths back to back: the ratio within a repeat is less exposed to
            # load that comes and goes during the run than the ratio of the medians.
            for name, key in (("job", "seconds"), ("job_in_worker", "worker_wall_s")):
                if name in paths:
                    paths[name]["paired_ratio_vs_copy"] = median(
                        [c["seconds"] / j[key] for c, j in zip(raw["psql_copy"], raw["job"]) if j[key]])
            results["sizes"][str(rows)] = {
                "account": acct["slug"], "neighbour_rows": acct["neighbour_rows"], "paths": paths,
                "outputs_identical": identical, "sha256": digests, "raw": raw,
            }
    finally:
        if cluster is not None:
            log("stopping qcluster")
            cluster.stop()

    results["machine"]["loadavg_end"] = list(os.getloadavg())
    full, small = results["sizes"][str(args.rows)], results["sizes"][str(args.small)]
    goals = results["goals"]
    if "job" in full["paths"]:
        ratio = full["paths"]["job"]["ratio_vs_copy"]
        goals["throughput"] = {
            "goal": f"job (enqueue -> succeeded) >= {THROUGHPUT_GOAL}x psql COPY rows/s at {args.rows:,} rows",
            "value": ratio, "in_worker_value": full["paths"]["job_in_worker"]["ratio_vs_copy"],
            "paired_value": full["paths"]["job"]["paired_ratio_vs_copy"],
            "pass": ratio is not None and ratio >= THROUGHPUT_GOAL,
        }
        cpu_s = full["paths"]["job"]["cpu_s"]
        cpu_per_million_s = cpu_s * 1_000_000 / args.rows if cpu_s is not None else None
        goals["cpu"] = {
            "goal": f"worker CPU per 1,000,000 rows <= {CPU_GOAL_S} s (TaskRun.cpu_ms, at {args.rows:,} rows)",
            "value": cpu_per_million_s,
            "pass": cpu_per_million_s is not None and cpu_per_million_s <= CPU_GOAL_S,
        }
        rss_full, rss_small = full["paths"]["job"]["peak_rss_kb"], small["paths"]["job"]["peak_rss_kb"]
        rss_ratio = rss_full / rss_small if rss_full and rss_small else None
        goals["memory"] = {
            "goal": f"worker peak RSS at {args.rows:,} rows <= {RSS_GOAL}x that at {args.small:,}",
            "value": rss_ratio, "peak_rss_kb": {str(args.small): rss_small, str(args.rows): rss_full},
            "pass": rss_ratio is not None and rss_ratio <= RSS_GOAL,
        }
    goals["outputs_identical"] = {
        "goal": "every path wrote byte-identical CSV (COPY output plus the header line)",
        "pass": all(s["outputs_identical"] for s in results["sizes"].values()),
    }

    print()
    print(results_table(results))
    print()
    for name, goal in goals.items():
        value = goal.get("value")
        extra = f" = {value:.2f}" if isinstance(value, float) else ""
        if name == "throughput" and goal.get("in_worker_value"):
            extra += (f" (in-worker {goal['in_worker_value']:.2f}; "
                      f"median of the per-repeat ratios {goal['paired_value']:.2f})")
        print(f"{'PASS' if goal['pass'] else 'MISS'}  {goal['goal']}{extra}")
    load = (info["loadavg_start"][0], results["machine"]["loadavg_end"][0])
    print(f"\nMB = 10^6 bytes; medians of {args.repeat} runs; client CPU = psql / the worker / the child process; "
          f"load average {load[0]:.2f} at start, {load[1]:.2f} at the end.")
    if max(load) > 0.5 * (os.cpu_count() or 1):
        print(f"WARNING: the machine was busy (load average above half of its {os.cpu_count()} CPUs): the job's "
              "Python and the PostgreSQL backend compete with other work for the cores, so the ratios are "
              "pessimistic and noisy. Rerun on a quiet machine for figures to compare.")

    h.write_results(args.json, results)
    if not goals["outputs_identical"]["pass"]:
        return 1
    return 1 if args.strict and not all(g["pass"] for g in goals.values()) else 0


if __name__ == "__main__":
    h.run(main)
