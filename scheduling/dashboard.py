"""The operations dashboard (/admin/dashboard/): queues, throughput and failures (marked, and the
latest named) over a range that can be switched (by default since the first run of the last 24 h,
or 1 h, 24 h, 14 days), CPU used against budget of the busiest budgets over 14 days, each account on
each queue apart (every queue has its own budget), held work by reason and by account, drawn as
server-side SVG with axes, units and values on hover.

Each panel is also served on its own (/admin/dashboard/panels/<name>/): as the HTML fragment the
page's script fetches every few seconds to refresh it, and with `?format=json` as data for scripts.

A fixed number of queries whatever the history, the accounts and the holding area hold: each
reads a bounded window through an index (task runs of the last hour or 24 h by `started_at`; the
daily ledger `UsageDay` and the daily roll-ups `TaskRunDaily` for 14 days), aggregated in the
database, and the holding area through its counts (Backlog). Above each query: what it reads as
the accounts, the held jobs and the history grow. The throughput panel's reads are in
scheduling/throughput.py.
"""
import datetime as dt
from collections import defaultdict
from dataclasses import dataclass

from django.contrib.admin.views.decorators import staff_member_required
from django.db.models import OuterRef, Q, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Coalesce
from django.http import Http404, HttpResponse, JsonResponse
from django.shortcuts import render
from django.template.loader import render_to_string
from django.utils import timezone

from budgets.models import Account, Budget, UsageDay
from budgets.tenancy import accounts_visible_to
from scheduling import charts
from scheduling.liveness import queue_health
from scheduling.models import Backlog, DeferReason, Pause, TaskRun
from scheduling.waits import held_counts
from scheduling.throughput import latest_failures, runs_per_day, throughput_1h, throughput_24h, throughput_recent

DAYS = 14
# The ranges the throughput panel can show (scheduling/throughput.py), the first the default. "recent"
# starts at the first run of the last 24 h: a fresh demo's first minute fills the chart, where a
# fixed 24 h showed one column at its right edge.
RANGES = {"recent": "since the first run of the last 24 h", "1h": "last hour, per 5 minutes",
          "24h": "last 24 h, per hour", "14d": "14 days, per day"}
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


# How many budgets (account and queue) the usage panel draws: those that used the most CPU over the window.
TOP_LINES = 12


def usage_against_budget(*, accounts, today: dt.date) -> list[dict]:
    """For the TOP_LINES budgets (an account on one queue) that used the most CPU over DAYS days:
    CPU seconds used per day and that queue's daily limit, never summed across queues (each queue
    has its own budget). Two queries, whatever the number of accounts: the top budgets (each
    visible budget's 14 ledger rows by the (account, queue, day) unique index: grows with the
    accounts, not the history), and their window of the ledger."""
    first = today - dt.timedelta(days=DAYS - 1)
    window = UsageDay.objects.filter(day__gte=first)
    spent = (window.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue")).values("account_id")
             .annotate(ms=Sum("cpu_used_ms")).values("ms"))
    top = list(Budget.objects.filter(account__in=accounts).annotate(ms=Coalesce(Subquery(spent), Value(0)))
               .order_by("-ms", "account__slug", "queue").values("account_id", "account__slug", "queue",
                                                                  "cpu_seconds_per_day")[:TOP_LINES])
    used: dict[tuple[int, str], dict[dt.date, float]] = defaultdict(dict)
    for row in (window.filter(account_id__in={b["account_id"] for b in top})
                .values("account_id", "queue", "day", "cpu_used_ms").order_by()):
        used[row["account_id"], row["queue"]][row["day"]] = row["cpu_used_ms"] / 1000
    days = [first + dt.timedelta(days=i) for i in range(DAYS)]
    rows = []
    for b in sorted(top, key=lambda b: (b["account__slug"], b["queue"])):
        mine = used[b["account_id"], b["queue"]]
        today_s, limit = mine.get(today, 0.0), b["cpu_seconds_per_day"]
        rows.append({"account": b["account__slug"], "queue": b["queue"], "limit_cpu_s": limit, "limit_text": f"{limit:,}",
                     "today_cpu_s": today_s,
                     "today_percent": round(100 * today_s / limit, 1) if limit else None,
                     "days": [d.isoformat() for d in days], "used_cpu_s": [mine.get(d, 0.0) for d in days]})
    return rows


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
        data = runs_per_day(where=Q() if scope.superuser else Q(account__in=scope.accounts), today=now.date(), days=DAYS)
    elif range_ == "24h":
        data = throughput_24h(runs=scope.runs(), now=now)
    else:
        data = throughput_recent(runs=scope.runs(), now=now)
    window = {"1h": dt.timedelta(hours=1), "14d": dt.timedelta(days=DAYS)}.get(range_, dt.timedelta(hours=24))
    return {"range": range_, "range_label": RANGES[range_], "unit": "runs", **data,
            "latest_failures": latest_failures(runs=scope.runs(), since=now - window)}


# How many accounts' lines the held panel names: those holding the most.
TOP_HELD = 10


def held_by_account(*, scope: Scope) -> list[dict]:
    """The TOP_HELD lines (an account on a queue) holding the most jobs, with their reasons: one
    query of the Backlog rows (one per account and queue: grows with the accounts, not the holding
    area)."""
    backlogs = Backlog.objects.filter(held__gt=0)
    if not scope.superuser:
        backlogs = backlogs.filter(account__in=scope.accounts)
    labels = dict(DeferReason.choices)
    return [{"account": row["account__slug"], "queue": row["queue"], "held": row["held"],
             "reasons": {labels[r]: row[r] for r in DeferReason.values if row[r]}}
            for row in backlogs.order_by("-held", "account__slug").values(
                "account__slug", "queue", "held", *DeferReason.values)[:TOP_HELD]]


def panel_held(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    # Pauses: one row per paused account or queue, by the pause's unique (account, queue) index.
    pauses = Pause.objects.select_related("account").filter(Q(account__isnull=True) | Q(account__in=scope.accounts))
    return {"held": held_by_reason(scope=scope), "accounts": held_by_account(scope=scope), "unit": "held jobs",
            "pauses": [str(p) for p in pauses.order_by("queue")]}


def panel_usage(*, scope: Scope, range_: str, now: dt.datetime) -> dict:
    return {"accounts": usage_against_budget(accounts=scope.accounts, today=now.date()), "unit": "CPU s"}


def _draw(name: str, data: dict) -> dict:
    """The charts of a panel, from its data."""
    if name == "throughput":
        return {"chart": charts.columns({"succeeded": data["succeeded"], "failed": data["failed"]}, data["labels"],
                                        colors={"succeeded": charts.USED, "failed": charts.FAILED}, unit="runs",
                                        x_unit=data["x_unit"], mark="failed")}
    if name == "held":
        return {"chart": charts.bars([(f"{row['label']} ({row['queue']})", row["held"]) for row in data["held"]],
                                     unit="held jobs", color=charts.HELD),
                "accounts_chart": charts.bars([(f"{row['account']} ({row['queue']})", row["held"])
                                               for row in data["accounts"]], unit="held jobs", color=charts.HELD)}
    if name == "usage":
        # A budget nothing used in DAYS days is a line of text, not an empty chart.
        return {"rows": [{**row, "chart": charts.columns(
            {"used": row["used_cpu_s"]}, [d[5:] for d in row["days"]], colors={"used": charts.USED},
            limit=[row["limit_cpu_s"]] * DAYS, unit="CPU s", height=110, x_unit="UTC, per day")
            if any(row["used_cpu_s"]) else ""} for row in data["accounts"]]}
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
