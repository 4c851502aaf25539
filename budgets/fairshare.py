"""Fair share now: who is using the workers, and who waits, why and for how long.

One row per account and queue (a budget: the unit admission, the cap and the holding area work
in): its share of the queue's worker time over the last 5 and 15 minutes, today's CPU against its
budget, running / sent against its cap (budgets.selectors.BudgetStatus), its held work by reason
(scheduling's Backlog counts) and its oldest held job. A column that belongs to a budget (a weight,
a rate limit) is one more field read with the budgets and one more cell.

Only the top rows are read ("top-N by use"): the accounts that used the workers most in the last
15 minutes, then those holding the most work, then those that spent the most CPU today, each
source asked for its own top N and merged (exact: every account with worker time is in the first
source, so those without come in the order of the second, then of the third). A search asks the
same sources for matching accounts only, plus matching idle budgets by slug. A fixed number of
queries whatever the number of accounts, held jobs and history; above each, what it reads.
"""
import datetime as dt
from dataclasses import dataclass, field

from django.conf import settings
from django.db.models import Case, F, OuterRef, Q, QuerySet, Subquery, Sum, Value, When
from django.utils import timezone

from budgets import clock, waits
from budgets.models import Account, Budget, UsageDay
from budgets.selectors import BudgetStatus, budget_status
from scheduling import clock as kernel_clock
from scheduling.gates import Wait
from scheduling.models import Backlog, DeferReason, DeferredTask, Pause, TaskRun, WorkerHeartbeat

WINDOWS_S = (300, 900)  # the shares shown: over the last 5 and 15 minutes
TOP, MAX_TOP = 25, 200


@dataclass(frozen=True)
class FairShareRow:
    account_id: int
    account_name: str
    budget_id: int
    status: BudgetStatus  # today's CPU, limit, running, sent, cap, held
    busy_s: dict[int, float]  # worker seconds used per window (WINDOWS_S)
    workers: int  # live workers of the queue now (the share's denominator)
    held_by_reason: dict[str, int] = field(default_factory=dict)
    oldest_held_at: dt.datetime | None = None
    oldest_held_reason: str = ""
    line_wait: Wait | None = None  # what its line waits for now (budgets.waits), when it has work in line
    paused: bool = False

    def share(self, window_s: int) -> float | None:
        """The part of the queue's worker time this budget used over the window (0 to 1), taking
        the queue's live workers as its capacity; None without live workers."""
        if not self.workers:
            return None
        return min(1.0, self.busy_s.get(window_s, 0.0) / (window_s * self.workers))

    def oldest_wait_s(self, now: dt.datetime) -> float | None:
        return None if self.oldest_held_at is None else max(0.0, (now - self.oldest_held_at).total_seconds())

    def as_json(self, now: dt.datetime) -> dict:
        s = self.status
        labels = dict(DeferReason.choices)
        return {
            "account": s.account, "account_name": self.account_name, "queue": s.queue,
            "worker_s": {f"{w // 60}m": round(self.busy_s.get(w, 0.0), 1) for w in WINDOWS_S},
            "share": {f"{w // 60}m": None if self.share(w) is None else round(self.share(w), 3) for w in WINDOWS_S},
            "live_workers": self.workers, "running": s.running, "sent": s.sent, "max_concurrent": s.max_concurrent,
            "held": s.held, "held_by_reason": {labels.get(r, r): n for r, n in self.held_by_reason.items()},
            "oldest_wait_s": None if self.oldest_held_at is None else round(self.oldest_wait_s(now), 1),
            "oldest_reason": labels.get(self.oldest_held_reason, self.oldest_held_reason),
            "line_waits_for": None if self.line_wait is None else {
                "reason": labels.get(self.line_wait.reason, self.line_wait.reason),
                "until": None if self.line_wait.eta is None else self.line_wait.eta.isoformat()},
            "cpu_used_s": s.cpu_used_ms / 1000, "cpu_reserved_s": s.cpu_reserved_ms / 1000,
            "cpu_limit_s": s.cpu_limit_ms / 1000, "paused": self.paused, "weight": s.weight,
            "rate_limit": None if s.rate_starts is None else {
                "starts": s.rate_starts, "period_s": s.rate_period_s, "recent_starts": s.recent_starts,
                "reached": s.rate_full},
        }


def longest_run_s() -> int:
    """No run lasts longer than its queue's time limit: a run that started earlier than this
    before a window cannot reach into it (the bound of the task-run reads below)."""
    clusters = [settings.Q_CLUSTER, *settings.Q_CLUSTER.get("ALT_CLUSTERS", {}).values()]
    return max(int(c.get("timeout") or 0) for c in clusters)


def worker_seconds(*, runs: QuerySet[TaskRun], now: dt.datetime) -> dict[tuple[int, str], dict[int, float]]:
    """Worker seconds per (account, queue) in each window of WINDOWS_S. Two queries, both by the
    task runs' `started_at` index: runs that started in the window and finished are summed in the
    database (their `wall_ms`; reads the last 15 minutes' runs: grows with the throughput, never
    with the accounts, the holding area or older history); the few that reach over a window's
    start or still run (at most one per worker, plus lost ones not reclaimed yet) are read, among
    the runs started within a queue's time limit before the window, and cut to the window here."""
    longest = max(WINDOWS_S)
    since = {w: now - dt.timedelta(seconds=w) for w in WINDOWS_S}
    busy: dict[tuple[int, str], dict[int, float]] = {}
    finished = runs.filter(account__isnull=False, started_at__gte=since[longest], finished_at__isnull=False)
    sums = {f"w{w}": Sum("wall_ms", filter=Q(started_at__gte=since[w])) for w in WINDOWS_S}
    for row in finished.values("account_id", "queue").annotate(**sums).order_by():
        busy[(row["account_id"], row["queue"])] = {w: (row[f"w{w}"] or 0) / 1000 for w in WINDOWS_S}
    edge = runs.filter(account__isnull=False, started_at__gte=now - dt.timedelta(seconds=longest + longest_run_s()),
                       started_at__lt=now).filter(
        Q(finished_at__isnull=True) | Q(started_at__lt=since[min(WINDOWS_S)], finished_at__gt=since[longest]))
    for account_id, queue, started, ended in edge.values_list("account_id", "queue", "started_at", "finished_at"):
        spans = busy.setdefault((account_id, queue), dict.fromkeys(WINDOWS_S, 0.0))
        for w in WINDOWS_S:
            if ended is not None and started >= since[w]:
                continue  # a finished run that started in the window: summed above
            spans[w] += max(0.0, (min(ended or now, now) - max(started, since[w])).total_seconds())
    return busy


def _matching(accounts: QuerySet[Account], search: str) -> QuerySet[Account]:
    return accounts.filter(Q(slug__icontains=search) | Q(name__icontains=search)) if search else accounts


def top_budgets(*, accounts: QuerySet[Account], superuser: bool, search: str, top: int,
                busy: dict[tuple[int, str], dict[int, float]]) -> list[tuple[int, str]]:
    """The `top` (account, queue) budgets by use, merged from the three sources (module docstring)."""
    visible = _matching(accounts, search)
    in_scope = Q() if superuser and not search else Q(account__in=visible)
    # Held work, most first: Backlog's rows of the visible accounts (one per account and queue with
    # held work, never the held jobs), sorted for the top N.
    held = dict(((a, q), n) for a, q, n in Backlog.objects.filter(in_scope, held__gt=0).order_by("-held")
                .values_list("account_id", "queue", "held")[:top])
    # Today's CPU, most first: today's ledger rows (the `usageday_day_account_queue` index; one per account and
    # queue that ran today), sorted for the top N.
    spent = dict(((a, q), ms) for a, q, ms in UsageDay.objects.filter(in_scope, day=clock.budget_day(), cpu_used_ms__gt=0)
                 .order_by("-cpu_used_ms").values_list("account_id", "queue", "cpu_used_ms")[:top])
    keys = set(busy) | set(held) | set(spent)
    if search:
        # Idle budgets of matching accounts, by slug (the account slug index, at most `top`).
        keys |= set(Budget.objects.filter(account__in=visible).order_by("account__slug", "queue")
                    .values_list("account_id", "queue")[:top])
    longest = max(WINDOWS_S)
    ranked = sorted(keys, key=lambda k: (-busy.get(k, {}).get(longest, 0.0), -held.get(k, 0), -spent.get(k, 0), k))
    return ranked[:top]


def fair_share_now(*, accounts: QuerySet[Account], superuser: bool, search: str = "", top: int = TOP,
                   now: dt.datetime | None = None) -> list[FairShareRow]:
    """The fair-share table for `accounts` (what the user may see): its top `top` budgets by use,
    or by use among the accounts matching `search` (slug or name)."""
    now = now or timezone.now()
    runs = TaskRun.objects.all() if superuser else TaskRun.objects.filter(account__in=accounts)
    busy = worker_seconds(runs=runs, now=now)
    if search:
        matching = set(_matching(accounts, search).filter(pk__in={a for a, _ in busy}).values_list("pk", flat=True))
        busy = {k: v for k, v in busy.items() if k[0] in matching}
    keys = top_budgets(accounts=accounts, superuser=superuser, search=search, top=top, busy=busy)
    if not keys:
        return []
    ids = {a for a, _ in keys}
    chosen = Account.objects.filter(pk__in=ids)
    # The chosen accounts' budgets, today's use and slots, and held counts: three queries by the
    # account indexes, for at most `top` accounts (budgets.selectors.budget_status).
    status = {(s.account, s.queue): s for s in budget_status(accounts=chosen)}
    # Their names and budget ids: by primary key and the budget's (account, queue) unique index.
    names = dict(chosen.values_list("pk", "name"))
    slugs = dict(chosen.values_list("pk", "slug"))
    budget_ids = {(a, q): pk for pk, a, q in Budget.objects.filter(account__in=ids).values_list("pk", "account_id", "queue")}
    # Held work by reason, and each line's oldest job: the chosen Backlog rows, and for each the
    # first of its held jobs by age (the `deferred_account_age` index: one entry read per row,
    # however many it holds).
    oldest = DeferredTask.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue")).order_by("created_at")
    backlogs = {(b.account_id, b.queue): b for b in Backlog.objects.filter(account__in=ids, held__gt=0).annotate(
        oldest_at=Subquery(oldest.values("created_at")[:1]),
        # Its reason if it waits for a time of its own; "" in line (it waits for what its line does).
        oldest_reason=Subquery(oldest.values(own=Case(When(in_line_since__isnull=False, then=Value("")),
                                                      default=F("reason")))[:1]))}
    # Pauses covering them (an account's, or a whole queue's): one row per pause, by its unique index.
    pauses = set(Pause.objects.filter(Q(account__in=ids) | Q(account__isnull=True)).values_list("account_id", "queue"))
    # Live workers per queue: one heartbeat row per worker process.
    heard_since = now - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
    workers: dict[str, int] = {}
    for queue in WorkerHeartbeat.objects.filter(seen_at__gte=heard_since).values_list("queue", flat=True):
        workers[queue] = workers.get(queue, 0) + 1
    clock_now = kernel_clock.now()  # held work's times are the kernel's clock's
    rows = []
    for account_id, queue in keys:
        s = status.get((slugs.get(account_id), queue))
        if s is None:  # a ledger row or a backlog left without a budget: nothing to show against
            continue
        backlog = backlogs.get((account_id, queue))
        paused = bool({(account_id, ""), (account_id, queue), (None, queue)} & pauses)
        # What its line waits for now, from what this page read (budgets.waits): no query more.
        line = None if backlog is None or not backlog.in_line else waits.line_wait(
            s, in_line=True, blocked_until=backlog.blocked_until, paused=paused, now=clock_now)
        rows.append(FairShareRow(
            account_id=account_id, account_name=names.get(account_id, ""), budget_id=budget_ids[(account_id, queue)],
            status=s, busy_s=busy.get((account_id, queue), dict.fromkeys(WINDOWS_S, 0.0)), workers=workers.get(queue, 0),
            held_by_reason=_held_by_reason(backlog, line),
            oldest_held_at=backlog.oldest_at if backlog else None,
            oldest_held_reason=_oldest_reason(backlog, line), line_wait=line, paused=paused))
    return rows


def _held_by_reason(backlog: Backlog | None, line: Wait | None) -> dict[str, int]:
    """A line's held jobs by what they wait for now: those in line for the line's reason, the others
    (waiting for a time of their own) for the reason they were held for."""
    if backlog is None:
        return {}
    held = backlog.by_reason()
    if line is not None:
        held[line.reason] = held.get(line.reason, 0) + backlog.in_line
    return held


def _oldest_reason(backlog: Backlog | None, line: Wait | None) -> str:
    """What the line's oldest held job waits for now: its line's reason, or its own time's."""
    if backlog is None:
        return ""
    return line.reason if not backlog.oldest_reason and line is not None else backlog.oldest_reason or ""
