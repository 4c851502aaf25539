"""The throughput panel's reads: finished runs and failures over a range (since the first run of
the last 24 h, the last hour, 24 h, 14 days), and the latest failures. Each reads a bounded window
through an index (task runs by `started_at`, the daily roll-ups by day), aggregated in the database:
a year of history reads as much as a day's.
"""
import datetime as dt
from collections import defaultdict

from django.db.models import Count, Min, Q, Sum
from django.db.models.functions import TruncDate, TruncHour, TruncMinute
from django.utils import timezone

from scheduling.models import Outcome, TaskRun, TaskRunDaily

FAILURES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)
# "recent": columns of one of these widths (minutes), the narrowest that needs at most RECENT_COLUMNS,
# over at least RECENT_MIN_SPAN minutes.
RECENT_BUCKETS_MIN, RECENT_COLUMNS, RECENT_MIN_SPAN = (1, 2, 5, 10, 15, 30, 60), 36, 10
# How many of the latest failed runs the throughput panel names.
LATEST_FAILURES = 3


def throughput_1h(*, runs, now: dt.datetime) -> dict:
    """Finished runs and failures per 5 minutes over the last hour. One query: the task runs
    started in the last hour (by the `started_at` index), grouped per minute in the database:
    at most 60 rows whatever the history or the accounts; it reads the hour's runs."""
    since = now.replace(second=0, microsecond=0)
    since -= dt.timedelta(minutes=since.minute % 5 + 55)  # 12 buckets of 5 minutes, the last one now's
    rows = (runs.filter(started_at__gte=since).annotate(minute=TruncMinute("started_at")).values("minute")
            .annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by())
    buckets = [since + dt.timedelta(minutes=5 * i) for i in range(12)]
    ok, failed = [0] * 12, [0] * 12
    for row in rows:
        i = min(int((row["minute"] - since).total_seconds() // 300), 11)
        ok[i] += row["n"] - row["failed"]
        failed[i] += row["failed"]
    return _series([b.strftime("%H:%M") for b in buckets], ok, failed, x_unit="UTC, per 5 min")


def throughput_recent(*, runs, now: dt.datetime) -> dict:
    """Finished runs and failures from the first run of the last 24 h to now, in at most
    RECENT_COLUMNS columns of 1 to 60 minutes. Two queries by the `started_at` index: the first run
    since a day ago (one index entry), then those runs grouped per minute or hour in the database
    (at most 1,440 rows); they read the day's runs, whatever the older history or the accounts."""
    first = runs.filter(started_at__gte=now - dt.timedelta(hours=24)).aggregate(first=Min("started_at"))["first"]
    if first is None:
        return {**throughput_1h(runs=runs, now=now), "range_label": "nothing ran in the last 24 h: the last hour"}
    span_min = max((now - first).total_seconds() / 60, RECENT_MIN_SPAN)
    bucket = next((b for b in RECENT_BUCKETS_MIN if span_min / b <= RECENT_COLUMNS), RECENT_BUCKETS_MIN[-1])
    since = first.replace(second=0, microsecond=0)
    since -= dt.timedelta(minutes=(since.hour * 60 + since.minute) % bucket)
    # At least RECENT_MIN_SPAN minutes of columns from the first run on: in the demo's first minute
    # its work is the first column of ten, which fill from the left as the minutes pass.
    n = max(int((now - since).total_seconds() // (bucket * 60)) + 1, RECENT_MIN_SPAN // bucket)
    trunc = TruncMinute("started_at") if bucket < 60 else TruncHour("started_at")
    rows = (runs.filter(started_at__gte=since).annotate(at=trunc).values("at")
            .annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by())
    ok, failed = [0] * n, [0] * n
    for row in rows:
        i = min(int((row["at"] - since).total_seconds() // (bucket * 60)), n - 1)
        ok[i] += row["n"] - row["failed"]
        failed[i] += row["failed"]
    width = "hour" if bucket == 60 else f"{bucket} min"
    labels = [(since + dt.timedelta(minutes=bucket * i)).strftime("%H:%M") for i in range(n)]
    return {**_series(labels, ok, failed, x_unit=f"UTC, per {width}"),
            "range_label": f"since {since:%H:%M} UTC (the first run of the last 24 h), per {width}"}


def latest_failures(*, runs, since: dt.datetime) -> list[dict]:
    """The LATEST_FAILURES latest failed runs since `since`: by the `started_at` index, newest first,
    read until that many failed ones are found (within the panel's window)."""
    return [{"id": r.pk, "job": r.job, "account": r.account.slug if r.account else "—", "outcome": r.get_outcome_display(),
             "error_class": r.error_class, "started_at": r.started_at.isoformat()}
            for r in runs.filter(started_at__gte=since, outcome__in=FAILURES).select_related("account")
            .order_by("-started_at")[:LATEST_FAILURES]]


def throughput_24h(*, runs, now: dt.datetime) -> dict:
    """Finished runs and failures per hour over the last 24 hours. One query: the runs of the last
    24 h by the `started_at` index, grouped per hour in the database (24 rows); it reads the day's
    runs, whatever the older history or the accounts."""
    since = now.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=23)
    rows = (runs.filter(started_at__gte=since).annotate(hour=TruncHour("started_at")).values("hour")
            .annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by())
    by_hour = {row["hour"]: row for row in rows}
    hours = [since + dt.timedelta(hours=i) for i in range(24)]
    ok = [by_hour.get(h, {}).get("n", 0) - by_hour.get(h, {}).get("failed", 0) for h in hours]
    failed = [by_hour.get(h, {}).get("failed", 0) for h in hours]
    return _series([h.strftime("%H:00") for h in hours], ok, failed, x_unit="UTC, per hour")


def runs_per_day(*, where: Q, today: dt.date, days: int) -> dict:
    """Runs per day over `days` days (of the runs `where` selects): the daily roll-ups for days already folded, the task runs
    for the rest. Two queries, each limited to the window by an index (`TaskRunDaily` rows of 14
    days: at most days x accounts x jobs x outcomes; task runs not rolled up yet, by `started_at`):
    a year of history reads as much as a day's."""
    first = today - dt.timedelta(days=days - 1)
    counts: dict[dt.date, list[int]] = defaultdict(lambda: [0, 0])
    for row in (TaskRunDaily.objects.filter(where, day__gte=first).values("day")
                .annotate(n=Sum("runs"), failed=Sum("runs", filter=Q(outcome__in=FAILURES))).order_by()):
        counts[row["day"]][0] += row["n"] or 0
        counts[row["day"]][1] += row["failed"] or 0
    since = timezone.make_aware(dt.datetime.combine(first, dt.time.min), dt.UTC)
    for row in (TaskRun.objects.filter(where, started_at__gte=since).annotate(day=TruncDate("started_at", tzinfo=dt.UTC))
                .values("day").annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by()):
        counts[row["day"]][0] += row["n"]
        counts[row["day"]][1] += row["failed"]
    shown = [first + dt.timedelta(days=i) for i in range(days)]
    return _series([d.strftime("%m-%d") for d in shown], [counts[d][0] - counts[d][1] for d in shown],
                   [counts[d][1] for d in shown], x_unit="UTC, per day")


def _series(labels: list[str], ok: list[int], failed: list[int], *, x_unit: str) -> dict:
    total = sum(ok) + sum(failed)
    return {"labels": labels, "succeeded": ok, "failed": failed, "total": total, "x_unit": x_unit,
            "failure_rate": round(100 * sum(failed) / total, 1) if total else 0.0}
