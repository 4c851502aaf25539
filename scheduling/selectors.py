"""Reads of the scheduling app that other apps share."""
from collections import Counter

from django.db.models import Count, QuerySet, Sum

from scheduling.models import Backlog, DeferReason, DeferredTask, Outcome, TaskRun


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
