"""The operations dashboard (/admin/dashboard/): queues, throughput and failures over a range that
can be switched (1 h, 24 h, 14 days), usage against budget of the busiest accounts over 14 days,
held work by reason, drawn as server-side SVG with axes, units and values on hover.

Each panel is also served on its own (/admin/dashboard/panels/<name>/): as the HTML fragment the
page's script fetches every few seconds to refresh it, and with `?format=json` as data for scripts.

A fixed number of queries whatever the history, the accounts and the holding area hold: each
reads a bounded window through an index (task runs of the last hour or 24 h by `started_at`; the
daily ledger `UsageDay` and the daily roll-ups `TaskRunDaily` for 14 days), aggregated in the
database, and the holding area through its counts (Backlog). Above each query: what it reads as
the accounts, the held jobs and the history grow.
"""
import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import Count, OuterRef, Q, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Coalesce, TruncDate, TruncHour, TruncMinute
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone

from budgets.models import Account, Budget, UsageDay
from budgets.tenancy import accounts_visible_to
from scheduling import charts
from scheduling.liveness import queue_health
from scheduling.models import Backlog, DeferReason, Outcome, Pause, TaskRun, TaskRunDaily
from scheduling.waits import held_counts

FAILURES = (Outcome.FAILED, Outcome.RETRYING, Outcome.LOST, Outcome.REJECTED)
DAYS = 14
# The ranges the throughput panel can show: (label, bucket), the first is the default.
RANGES = {"24h": "last 24 h, per hour", "1h": "last hour, per 5 minutes", "14d": "14 days, per day"}
# How often the page's script fetches its panels again, in seconds (?refresh= within these bounds).
REFRESH_S, REFRESH_BOUNDS_S = 5, (2, 300)


@dataclass(frozen=True)
class Scope:
    """Whose figures a page shows: a superuser's are everyone's, a tenant's only its accounts'."""

    superuser: bool
    accounts: QuerySet[Account]

    def runs(self) -> QuerySet[TaskRun]:
        return TaskRun.objects.all() if self.superuser else TaskRun.objects.filter(account__in=self.accounts)


def scope_of(user) -> Scope:
    return Scope(superuser=user.is_superuser, accounts=accounts_visible_to(user=user))


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


def runs_per_day(*, scope: Scope, today: dt.date) -> dict:
    """Runs per day over DAYS days: the daily roll-ups for days already folded, the task runs
    for the rest. Two queries, each limited to the window by an index (`TaskRunDaily` rows of 14
    days: at most days x accounts x jobs x outcomes; task runs not rolled up yet, by `started_at`):
    a year of history reads as much as a day's."""
    first = today - dt.timedelta(days=DAYS - 1)
    where = Q() if scope.superuser else Q(account__in=scope.accounts)
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
    days = [first + dt.timedelta(days=i) for i in range(DAYS)]
    return _series([d.strftime("%m-%d") for d in days], [counts[d][0] - counts[d][1] for d in days],
                   [counts[d][1] for d in days], x_unit="UTC, per day")


def _series(labels: list[str], ok: list[int], failed: list[int], *, x_unit: str) -> dict:
    total = sum(ok) + sum(failed)
    return {"labels": labels, "succeeded": ok, "failed": failed, "total": total, "x_unit": x_unit,
            "failure_rate": round(100 * sum(failed) / total, 1) if total else 0.0}


# How many accounts the usage panel draws: those that used the most CPU over the window.
TOP_ACCOUNTS = 12


def usage_against_budget(*, accounts, today: dt.date) -> list[dict]:
    """For the TOP_ACCOUNTS accounts that used the most CPU over DAYS days: CPU seconds used per
    day (every queue), and today's limit. Three queries, whatever the number of accounts: the top
    accounts (each visible account's 14 ledger rows per queue by the (account, queue, day) unique
    index: grows with the accounts, not the history), their window of the ledger, their budgets."""
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
    return [{"account": slug, "limit_cpu_s": limit, "today_cpu_s": used[slug].get(today, 0.0),
             "days": [d.isoformat() for d in days], "used_cpu_s": [used[slug].get(d, 0.0) for d in days]}
            for slug, limit in sorted(limits.items())]


def held_by_reason(*, scope: Scope) -> list[dict]:
    """Held jobs by reason and queue: the accounts' Backlog counts (one row per account and queue
    read, never the held jobs: grows with the accounts, not the holding area), and for superusers
    the account-less ones (parked or scheduled system work: few, by their account column's
    index). Two queries."""
    counts = held_counts(backlogs=Backlog.objects.all() if scope.superuser else Backlog.objects.filter(
        account__in=scope.accounts), account_less=scope.superuser)
    labels = dict(DeferReason.choices)
    return [{"queue": queue, "reason": reason, "label": labels.get(reason, reason), "held": n}
            for (queue, reason), n in sorted(counts.items(), key=lambda item: -item[1])]


def panel_queues(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    # The broker is shared: its figures are everyone's, so only superusers see them. Per queue:
    # the broker's size and its oldest message (ORM broker: by the OrmQ key index), live workers
    # (heartbeats: one row per worker process).
    queues = queue_health() if scope.superuser else []
    return {"queues": [{"queue": q.queue, "waiting": q.depth, "oldest_s": round(q.oldest_age_s, 1),
                        "workers": q.workers, "stalled": q.stalled} for q in queues]}


def panel_throughput(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    if range_ == "1h":
        data = throughput_1h(runs=scope.runs(), now=now)
    elif range_ == "14d":
        data = runs_per_day(scope=scope, today=now.date())
    else:
        data = throughput_24h(runs=scope.runs(), now=now)
    return {"range": range_, "range_label": RANGES[range_], "unit": "runs", **data}


def panel_held(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    # Pauses: one row per paused account or queue, by the pause's unique (account, queue) index.
    pauses = Pause.objects.select_related("account").filter(Q(account__isnull=True) | Q(account__in=scope.accounts))
    return {"held": held_by_reason(scope=scope), "unit": "held jobs",
            "pauses": [str(p) for p in pauses.order_by("queue")]}


def panel_usage(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    return {"accounts": usage_against_budget(accounts=scope.accounts, today=now.date()), "unit": "CPU s"}


def _draw(name: str, data: dict) -> dict:
    """The charts of a panel, from its data."""
    if name == "throughput":
        return {"chart": charts.columns({"succeeded": data["succeeded"], "failed": data["failed"]}, data["labels"],
                                        colors={"succeeded": charts.USED, "failed": charts.FAILED}, unit="runs",
                                        x_unit=data["x_unit"])}
    if name == "held":
        return {"chart": charts.bars([(f"{row['label']} ({row['queue']})", row["held"]) for row in data["held"]],
                                     unit="held", color=charts.HELD)}
    if name == "usage":
        return {"rows": [{**row, "chart": charts.columns(
            {"used": row["used_cpu_s"]}, [d[5:] for d in row["days"]], colors={"used": charts.USED},
            limit=[row["limit_cpu_s"]] * DAYS, unit="CPU s", height=110, x_unit="UTC, per day")}
            for row in data["accounts"]]}
    return {}


PANELS = {"queues": panel_queues, "throughput": panel_throughput, "held": panel_held, "usage": panel_usage}


def _range(request) -> str:
    value = request.GET.get("range", "")
    return value if value in RANGES else next(iter(RANGES))


def refresh_s(request) -> int:
    """The page's refresh interval: ?refresh=N seconds within REFRESH_BOUNDS_S, else REFRESH_S."""
    try:
        return min(max(int(request.GET.get("refresh", REFRESH_S)), REFRESH_BOUNDS_S[0]), REFRESH_BOUNDS_S[1])
    except ValueError:
        return REFRESH_S


def _panel(name: str, *, scope: Scope, range_: str, now: dt.datetime) -> dict:
    data = PANELS[name](scope=scope, range_=range_, now=now)
    return {"name": name, "data": data, **_draw(name, data)}


def _fragment(request, panel: dict) -> str:
    return render_to_string(f"admin/ops/panel_{panel['name']}.html", {"panel": panel, **panel}, request=request)


@staff_member_required
def dashboard(request):
    scope, now, range_ = scope_of(request.user), timezone.now(), _range(request)
    names = [name for name in PANELS if scope.superuser or name != "queues"]
    panels = [{**(panel := _panel(name, scope=scope, range_=range_, now=now)), "html": _fragment(request, panel)}
              for name in names]
    context = {"title": "Operations dashboard", "panels": panels, "range": range_, "ranges": RANGES,
               "refresh_s": refresh_s(request)}
    return render(request, "admin/dashboard.html", {**_admin_context(request), **context})


@staff_member_required
def dashboard_panel(request, name: str):
    """One panel: its HTML fragment (what the page's script refreshes), or `?format=json`."""
    scope = scope_of(request.user)
    if name not in PANELS or (name == "queues" and not scope.superuser):
        raise Http404("no such panel")
    panel = _panel(name, scope=scope, range_=_range(request), now=timezone.now())
    if request.GET.get("format") == "json":
        return JsonResponse({"panel": name, "generated_at": timezone.now().isoformat(), **panel["data"]})
    return HttpResponse(_fragment(request, panel))


def _admin_context(request) -> dict:
    from django.contrib import admin  # the site's header, user links and theme

    return admin.site.each_context(request)
