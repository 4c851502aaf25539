"""Reads of the scheduling app that other apps share."""
import datetime as dt

from scheduling.models import NOT_STARTED, Outcome, TaskRun


def finished_run_cpu_ms(*, run_id: int) -> int | None:
    """The CPU a run recorded when it finished; None while it is still running (or if it is gone)."""
    return (TaskRun.objects.filter(pk=run_id).exclude(outcome=Outcome.RUNNING)
            .values_list("cpu_ms", flat=True).first())


def recent_starts(*, account_id: int, queue: str, since: dt.datetime, limit: int) -> list[dt.datetime]:
    """When the account's latest runs on the queue started, newest first: those since `since` (a
    rate limit's window), at most `limit` (index taskrun_account_queue_started: at most `limit`
    entries read, whatever the history holds). The SQL function fairshare_window (migration 0023) in SQL."""
    return list(TaskRun.objects.filter(account_id=account_id, queue=queue, started_at__gt=since)
                .exclude(outcome__in=NOT_STARTED).order_by("-started_at").values_list("started_at", flat=True)[:limit])
