"""Reads of the scheduling app that other apps share."""
import datetime as dt
from collections import Counter
from dataclasses import dataclass

from django.db.models import Count, OuterRef, QuerySet, Subquery, Sum

from scheduling.models import NOT_STARTED, Backlog, DeferReason, DeferredTask, Outcome, TaskRun


def finished_run_cpu_ms(*, run_id: int) -> int | None:
    """The CPU a run recorded when it finished; None while it is still running (or if it is gone)."""
    return (TaskRun.objects.filter(pk=run_id).exclude(outcome=Outcome.RUNNING)
            .values_list("cpu_ms", flat=True).first())


def held_counts(*, backlogs: QuerySet[Backlog], account_less: bool) -> Counter:
    """Held jobs by (queue, reason): the Backlog rows' counts summed per queue (one query, one row
    per account and queue read, never the held jobs), plus, with `account_less`, the held jobs of no
    account (parked or scheduled system work: few, by the index of their account column)."""
    counts: Counter = Counter()
    for row in backlogs.values("queue").annotate(**{reason: Sum(reason) for reason in DeferReason.values}).order_by():
        counts.update({(row["queue"], reason): row[reason] for reason in DeferReason.values if row[reason]})
    if account_less:
        counts.update({(r["queue"], r["reason"]): r["n"] for r in DeferredTask.objects.filter(account__isnull=True)
                       .values("queue", "reason").annotate(n=Count("pk")).order_by()})
    return counts


def recent_starts(*, account_id: int, queue: str, since: dt.datetime, limit: int) -> list[dt.datetime]:
    """When the account's latest runs on the queue started, newest first: those since `since` (a
    rate limit's window), at most `limit` (index taskrun_account_queue_started: at most `limit`
    entries read, whatever the history holds). scheduling.sql's `recent_starts` in SQL."""
    return list(TaskRun.objects.filter(account_id=account_id, queue=queue, started_at__gt=since)
                .exclude(outcome__in=NOT_STARTED).order_by("-started_at").values_list("started_at", flat=True)[:limit])


def with_their_line(held: QuerySet[DeferredTask]) -> QuerySet[DeferredTask]:
    """Held jobs with what their account's line waits for (`line_held_up`): until when it is held
    up, and whether by its rate limit (its first job says "rate limited") rather than its budget.
    Two lookups of the job's Backlog row by its unique key."""
    line = Backlog.objects.filter(account_id=OuterRef("account_id"), queue=OuterRef("queue"))
    return held.annotate(line_blocked_until=Subquery(line.values("blocked_until")[:1]),
                         line_rate_limited=Subquery(line.filter(rate_limited__gt=0, budget_exhausted=0).values("pk")[:1]))


def line_held_up(held: DeferredTask, now: dt.datetime) -> tuple[dt.datetime, str] | None:
    """Until when a job in its account's line waits with the whole line, and why ("rate limit",
    "budget"); None when the line may go (it waits for a slot). Read from `with_their_line`."""
    until = getattr(held, "line_blocked_until", None)
    if held.in_line_since is None or until is None or until <= now:
        return None
    return until, "rate limit" if getattr(held, "line_rate_limited", None) else "budget"


@dataclass(frozen=True)
class HoldShown:
    """What a person is told about a held job: why it waits, and from when it may run (`eligible_from`)
    or, when no time is known, what it waits for (`waits_for`, to follow "when": a slot frees, an operator resumes it...)."""

    reason: str
    eligible_from: dt.datetime | None
    waits_for: str = ""


def hold_shown(held: DeferredTask, *, now: dt.datetime) -> HoldShown:
    """The one reading of a held job's reason and ETA that the admin pages show (the holding area,
    a task call's page): a job in its account's line that its line holds up shows the line's reason
    and time, not the copy on the job. Read from `with_their_line`."""
    reason = held.get_reason_display()
    if held.reason == DeferReason.NEEDS_NEWER_WORKER:
        return HoldShown(reason, None, f"a worker that speaks envelope v{held.envelope_version} runs")
    if held.in_line_since is None:  # it waits for a time of its own (back-off, run_after, a pause)
        if held.reason == DeferReason.PAUSED:  # held until resumed (scheduling.pausing.UNTIL_RESUMED)
            return HoldShown(reason, None, "an operator resumes it")
        return HoldShown(reason, held.eligible_at)
    held_up = line_held_up(held, now)
    if held_up is not None:
        until, why = held_up
        reason = DeferReason.RATE_LIMITED.label if why == "rate limit" else DeferReason.BUDGET_EXHAUSTED.label
        return HoldShown(reason, until)
    return HoldShown(reason, None, "a slot frees")
