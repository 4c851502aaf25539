"""The operations dashboard (/admin/dashboard/): queues, throughput and failures over 24 h, usage
against budget of the busiest accounts over 14 days, held work by reason, drawn as server-side SVG.

A fixed number of queries whatever the history, the accounts and the holding area hold: each
reads a bounded window through an index (task runs of the last 24 h by `started_at`; the daily
ledger `UsageDay` and the daily roll-ups `TaskRunDaily` for 14 days), aggregated in the database,
and the holding area through its counts (Backlog).
"""
import datetime as dt
from collections import defaultdict

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Count, OuterRef, Q, Subquery, Sum, Value
from django.db.models.functions import Coalesce, TruncDate, TruncHour
from django.shortcuts import render
from django.utils import timezone

from budgets.models import Budget, UsageDay
from budgets.tenancy import accounts_visible_to
from scheduling import charts
from scheduling.liveness import queue_health
from scheduling.models import Backlog, DeferReason, Outcome, Pause, TaskRun, TaskRunDaily
from scheduling.selectors import held_counts

FAILURES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)
DAYS = 14


def throughput_24h(*, runs, now: dt.datetime) -> dict:
    """Finished runs and failures per hour over the last 24 hours (one query)."""
    since = now.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=23)
    rows = (runs.filter(started_at__gte=since).annotate(hour=TruncHour("started_at")).values("hour")
            .annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by())
    by_hour = {row["hour"]: row for row in rows}
    hours = [since + dt.timedelta(hours=i) for i in range(24)]
    ok = [by_hour.get(h, {}).get("n", 0) - by_hour.get(h, {}).get("failed", 0) for h in hours]
    failed = [by_hour.get(h, {}).get("failed", 0) for h in hours]
    total = sum(ok) + sum(failed)
    return {"labels": [h.strftime("%H:00") for h in hours], "ok": ok, "failed": failed, "total": total,
            "failure_rate": round(100 * sum(failed) / total, 1) if total else 0.0}


def runs_per_day(*, accounts, today: dt.date, superuser: bool) -> dict:
    """Runs per day over DAYS days: the daily roll-ups for days already folded, the task runs
    for the rest (two queries, each limited to the window)."""
    first = today - dt.timedelta(days=DAYS - 1)
    scope = Q() if superuser else Q(account__in=accounts)
    counts: dict[dt.date, list[int]] = defaultdict(lambda: [0, 0])
    for row in (TaskRunDaily.objects.filter(scope, day__gte=first).values("day")
                .annotate(n=Sum("runs"), failed=Sum("runs", filter=Q(outcome__in=FAILURES))).order_by()):
        counts[row["day"]][0] += row["n"] or 0
        counts[row["day"]][1] += row["failed"] or 0
    since = timezone.make_aware(dt.datetime.combine(first, dt.time.min), dt.UTC)
    for row in (TaskRun.objects.filter(scope, started_at__gte=since).annotate(day=TruncDate("started_at", tzinfo=dt.UTC))
                .values("day").annotate(n=Count("pk"), failed=Count("pk", filter=Q(outcome__in=FAILURES))).order_by()):
        counts[row["day"]][0] += row["n"]
        counts[row["day"]][1] += row["failed"]
    days = [first + dt.timedelta(days=i) for i in range(DAYS)]
    return {"labels": [d.isoformat() for d in days], "ok": [counts[d][0] - counts[d][1] for d in days],
            "failed": [counts[d][1] for d in days]}


# How many accounts the usage panel draws: those that used the most CPU over the window.
TOP_ACCOUNTS = 12


def usage_against_budget(*, accounts, today: dt.date) -> list[dict]:
    """For the TOP_ACCOUNTS accounts that used the most CPU over DAYS days: CPU seconds used per
    day (every queue), and today's limit (three queries, whatever the number of accounts: the
    top accounts, their window of the ledger, their budgets)."""
    first = today - dt.timedelta(days=DAYS - 1)
    window = UsageDay.objects.filter(day__gte=first)
    spent = (window.filter(account_id=OuterRef("pk")).values("account_id").annotate(ms=Sum("cpu_used_ms")).values("ms"))
    top = list(accounts.filter(budgets__isnull=False).distinct()
               .annotate(ms=Coalesce(Subquery(spent), Value(0))).order_by("-ms", "slug")
               .values_list("pk", flat=True)[:TOP_ACCOUNTS])
    used: dict[str, dict[dt.date, float]] = defaultdict(dict)
    for row in (window.filter(account_id__in=top).values("account__slug", "day")
                .annotate(ms=Sum("cpu_used_ms")).order_by()):
        used[row["account__slug"]][row["day"]] = row["ms"] / 1000
    limits = dict(Budget.objects.filter(account_id__in=top).values("account__slug")
                  .annotate(s=Sum("cpu_seconds_per_day")).values_list("account__slug", "s").order_by())
    days = [first + dt.timedelta(days=i) for i in range(DAYS)]
    return [{"account": slug, "limit": limit, "today": used[slug].get(today, 0.0),
             "chart": charts.columns({"used": [used[slug].get(d, 0.0) for d in days]}, [d.isoformat() for d in days],
                                     colors={"used": charts.USED}, limit=[limit] * DAYS, unit="CPU s", height=70)}
            for slug, limit in sorted(limits.items())]


def held_by_reason(*, accounts, superuser: bool) -> list[tuple[str, float]]:
    """Held jobs by reason and queue: the accounts' Backlog counts (not the held jobs), and for
    superusers the account-less ones (parked or scheduled system work). Two queries."""
    counts = held_counts(backlogs=Backlog.objects.all() if superuser else Backlog.objects.filter(account__in=accounts),
                         account_less=superuser)
    labels = dict(DeferReason.choices)
    return [(f"{labels.get(reason, reason)} ({queue})", n)
            for (queue, reason), n in sorted(counts.items(), key=lambda item: -item[1])]


@staff_member_required
def dashboard(request):
    superuser = request.user.is_superuser
    accounts = accounts_visible_to(user=request.user)
    now = timezone.now()
    runs = TaskRun.objects.all() if superuser else TaskRun.objects.filter(account__in=accounts)
    hourly = throughput_24h(runs=runs, now=now)
    daily = runs_per_day(accounts=accounts, today=now.date(), superuser=superuser)
    queues = queue_health() if superuser else []  # the broker is shared: its figures are everyone's
    context = {
        "title": "Operations dashboard",
        "queues": queues,
        "queue_chart": charts.bars([(q.queue, q.depth) for q in queues], unit="waiting"),
        "age_chart": charts.bars([(q.queue, q.oldest_age_s) for q in queues], unit="s", color=charts.HELD),
        "hourly": hourly,
        "hourly_chart": charts.columns({"succeeded": hourly["ok"], "failed": hourly["failed"]}, hourly["labels"],
                                       colors={"succeeded": charts.USED, "failed": charts.FAILED}, unit="runs"),
        "daily_chart": charts.columns({"succeeded": daily["ok"], "failed": daily["failed"]}, daily["labels"],
                                      colors={"succeeded": charts.USED, "failed": charts.FAILED}, unit="runs"),
        "usage": usage_against_budget(accounts=accounts, today=now.date()),
        "held_chart": charts.bars(held_by_reason(accounts=accounts, superuser=superuser), unit="held", color=charts.HELD),
        "pauses": list(Pause.objects.select_related("account").filter(
            Q(account__isnull=True) | Q(account__in=accounts)).order_by("queue")),
    }
    return render(request, "admin/dashboard.html", {**_admin_context(request), **context})


def _admin_context(request) -> dict:
    from django.contrib import admin  # the site's header, user links and theme

    return admin.site.each_context(request)
