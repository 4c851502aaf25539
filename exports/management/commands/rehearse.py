import json
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from exports.rehearsal import MIN_GAIN, RehearsalError, RehearsalPlan, rehearse


def _concurrencies(value: str) -> tuple[int, ...]:
    try:
        values = sorted({int(v) for v in value.split(",") if v.strip()})
    except ValueError:
        raise CommandError(f"--concurrency takes comma-separated worker counts, e.g. 1,2,4 (got {value!r})") from None
    if not values or values[0] < 1:
        raise CommandError("--concurrency needs at least one worker count of 1 or more")
    return tuple(values)


class Command(BaseCommand):
    help = (
        "Capacity rehearsal: replay the same backlog (N exports, then M small jobs, of the dedicated "
        "'rehearsal' account) against real qcluster processes once per export-worker count, and "
        "compare useful exports per minute, the oldest job's wait, p95 latency, errors, the exports' "
        "CPU / DB-wait / storage-wait share, peak RSS per export worker and host load. Applies the "
        f"stop rule (a step that adds less than {MIN_GAIN:.0%} throughput while the DB-wait share "
        "grows ends the search), prints a table and a recommended concurrency with its memory budget, "
        "and writes the results as JSON. Each round starts its own clusters (the exports queue with "
        "that many workers, the default queue with 2) on this database and stops them by PID. Run it "
        "on a scratch database: it creates the 'rehearsal' account with --rows activity rows and "
        "deletes that account's exports, files, task runs, held work and usage before every round."
    )

    def add_arguments(self, parser):
        parser.add_argument("--concurrency", type=_concurrencies, default=(1, 2, 4),
                            help="export worker counts to try, comma-separated (default 1,2,4)")
        parser.add_argument("--exports", type=int, default=12, help="exports in the backlog of each round (default 12)")
        parser.add_argument("--small-jobs", type=int, default=200,
                            help="small jobs (scheduling.noop, default queue) in each round's backlog (default 200)")
        parser.add_argument("--rows", type=int, default=200_000,
                            help="activity rows of the rehearsal account, over 90 days; exports cover the "
                                 "last 30, 60 or 90 of them in turn (default 200000)")
        parser.add_argument("--timeout", type=float, default=600,
                            help="seconds each round may take once its backlog is enqueued (default 600)")
        parser.add_argument("--json", dest="json_path",
                            default=str(Path(settings.BASE_DIR) / "bench/results/rehearsal.json"),
                            help="where to write the results (default bench/results/rehearsal.json)")

    def handle(self, *, concurrency, exports, small_jobs, rows, timeout, json_path, **options):
        if exports < 1 or small_jobs < 0 or rows < 1:
            raise CommandError("--exports and --rows must be at least 1, --small-jobs at least 0")
        plan = RehearsalPlan(concurrencies=concurrency, exports=exports, small_jobs=small_jobs, rows=rows,
                             timeout_s=timeout)
        try:
            report = rehearse(plan, say=self.stdout.write)
        except RehearsalError as exc:
            raise CommandError(str(exc)) from exc
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")

        rec = report["recommendation"]
        self.stdout.write("")
        self.stdout.write(report["table"])
        self.stdout.write("")
        self.stdout.write(f"Stop rule: {rec['reason']}.")
        self.stdout.write(self.style.SUCCESS(
            f"Recommendation: {rec['concurrency']} export worker(s); memory budget for the exports queue "
            f"{rec['memory_budget_mib']} MiB ({rec['peak_rss_per_export_mib']:.0f} MiB peak RSS per active export "
            f"x {rec['concurrency']}), plus runtime overhead."))
        self.stdout.write(f"Results written to {path}")
