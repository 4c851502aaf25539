"""What a held job waits for now, as everyone is shown it (the holding area's admin, a task call's
page, Fair share now, /metrics): one question, `why_held`, answered here only.

A job that waits for a time of its own (a back-off, a `run_after`, a pause) waits for that; a
parked message for a newer worker; a job in its account's line for whatever its line waits for
now, as the enqueue gates explain it (budgets': the first cause its rule finds: out of CPU until
the next budget day, rate limited until T, at its cap, paused, every worker busy), never the reason
stored when it was held, which goes stale as its account's standing changes.

Cost: one explanation per line shown (budgets': its standing, one statement by index), whatever
the line holds.
"""
import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.db.models import Count, QuerySet, Sum
from django.utils.timesince import timeuntil

from scheduling import clock
from scheduling.gates import Wait, enqueue_gates
from scheduling.models import Backlog, DeferReason, DeferredTask
from scheduling.pausing import UNTIL_RESUMED


def explain_lines(lines: set[tuple[int, str]]) -> dict[tuple[int, str], Wait]:
    """What each (account id, queue) line waits for now, as far as the gates say."""
    explained: dict[tuple[int, str], Wait] = {}
    for gate in enqueue_gates():
        explained.update(gate.explain_lines(lines=lines - set(explained)))
    return explained


def why_held(held: list[DeferredTask]) -> dict[int, Wait]:
    """What each held job waits for now, and from when it may go, by its id."""
    lines = explain_lines({(h.account_id, h.queue) for h in held
                           if h.in_line_since is not None and h.account_id is not None})
    waits = {}
    for h in held:
        if h.reason == DeferReason.NEEDS_NEWER_WORKER:
            waits[h.pk] = Wait(h.reason, None)
        elif h.in_line_since is not None and (h.account_id, h.queue) in lines:
            waits[h.pk] = lines[(h.account_id, h.queue)]
        else:
            waits[h.pk] = Wait(h.reason, h.eligible_at)
    return waits


def held_counts(*, backlogs: QuerySet[Backlog], account_less: bool) -> Counter:
    """Held jobs by (queue, reason), each by what it waits for now: out of their line, by the reason
    they were held for (Backlog's per-reason counts summed per queue: a row per account and queue
    read, never the held jobs); in a line held up until a time, by the block's reason (the same
    rows); in any other line, by the line's explanation (`explain_lines`: one per line with work in
    line that is not held up, i.e. whose account could run or waits at its cap or pause, by index
    backlog_ready). With `account_less`, the held jobs of no account (parked or scheduled system
    work: few, by the index of their account column)."""
    now = clock.now()
    counts: Counter = Counter()
    for row in backlogs.values("queue").annotate(**{reason: Sum(reason) for reason in DeferReason.values}).order_by():
        counts.update({(row["queue"], reason): row[reason] for reason in DeferReason.values if row[reason]})
    lined = backlogs.filter(lined=True)
    for row in (lined.filter(blocked_until__gt=now).values("queue", "blocked_reason")
                .annotate(n=Sum("in_line")).order_by()):
        counts[(row["queue"], row["blocked_reason"] or DeferReason.BUDGET_EXHAUSTED)] += row["n"]
    open_lines = {(a, q): n for a, q, n in lined.filter(blocked_until__lte=now).values_list("account_id", "queue", "in_line")}
    explained = explain_lines(set(open_lines))
    for (account_id, queue), n in open_lines.items():
        counts[(queue, explained.get((account_id, queue), Wait(DeferReason.WORKERS_BUSY, None)).reason)] += n
    if account_less:
        counts.update({(r["queue"], r["reason"]): r["n"] for r in DeferredTask.objects.filter(account__isnull=True)
                       .values("queue", "reason").annotate(n=Count("pk")).order_by()})
    return counts


def wait_text(wait: Wait, now: dt.datetime) -> str:
    """What a person reads of a wait: its reason and when it may go ("until 2026-12-05 00:00 UTC, in
    6 hours"), or for what ("when one of its runs ends", "when a worker is free")."""
    label = _label(wait.reason)
    return f"{label}, {eta_text(wait, now)}" if eta_text(wait, now) else label


def eta_text(wait: Wait, now: dt.datetime) -> str:
    """When the held work may go, in words."""
    if wait.eta is not None and wait.eta >= UNTIL_RESUMED:
        return "until resumed"
    if wait.eta is not None and wait.eta > now:
        return f"until {wait.eta:%Y-%m-%d %H:%M} UTC (in {timeuntil(wait.eta, now)})"
    waits_for = _WAITS_FOR.get(wait.reason)
    return f"when {waits_for}" if waits_for else ("" if wait.eta is None else "now")


@dataclass(frozen=True)
class HoldShown:
    """What a person is told about a held job (the admin's holding area and task calls): why it waits
    (a label), and from when it may run (`eligible_from`) or, with no time known, what it waits for
    (`waits_for`, to follow "when": a worker is free, an operator resumes it, ...)."""

    reason: str
    eligible_from: dt.datetime | None
    waits_for: str = ""


def hold_shown(held: DeferredTask, *, now: dt.datetime, wait: Wait | None = None) -> HoldShown:
    """`why_held` of one job (or its `wait`, read for a page at once) as the admin shows it."""
    wait = why_held([held])[held.pk] if wait is None else wait
    label = _label(wait.reason)
    if wait.reason == DeferReason.NEEDS_NEWER_WORKER:
        return HoldShown(label, None, f"a worker that speaks envelope v{held.envelope_version} runs")
    if wait.eta is not None and wait.eta >= UNTIL_RESUMED:
        return HoldShown(label, None, "an operator resumes it")
    if wait.eta is None or (wait.eta <= now and wait.reason in _WAITS_FOR):
        return HoldShown(label, None, _WAITS_FOR.get(wait.reason, "a worker is free"))
    return HoldShown(label, wait.eta)


def _label(reason: str) -> str:
    return DeferReason(reason).label if reason in DeferReason.values else reason


# What a wait with no time (or one that came) waits for, to follow "when".
_WAITS_FOR = {
    DeferReason.CONCURRENCY_CAP: "one of its runs ends",
    DeferReason.BUDGET_RESERVED: "one of its runs ends and gives back what it did not use",
    DeferReason.WORKERS_BUSY: "a worker is free",
    DeferReason.QUEUED_BEHIND: "the work before it in its line has gone",
}
