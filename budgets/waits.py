"""What an account's line on a queue waits for now, and until when: the budget gate's explanation
of held work (scheduling.waits asks it for every held job shown), decided by the one rule that
decides whether its work may go (budgets.standing.refusal) on the line's standing, so that what
anyone is shown is what holds the line now, never a reason stored when a job was held.

The standing is read in a batch (budgets.selectors.budget_status, the Backlog rows, the pauses): a
fixed number of queries for any number of lines, each reading the lines' accounts' rows by index.
Between two slots' changes it may be a moment old, as any page is; it decides nothing.
"""
import datetime as dt

from django.db.models import Q

from budgets import clock, standing
from budgets.models import Account
from budgets.selectors import BudgetStatus, among, budget_status
from budgets.standing import Standing
from scheduling.gates import Wait
from scheduling.models import ACCOUNT_WAITS_REASONS, NOT_BLOCKED, Backlog, DeferReason, Pause


def line_wait(status: BudgetStatus, *, in_line: bool, blocked_until: dt.datetime, paused: bool,
              now: dt.datetime) -> Wait:
    """The first cause the rule finds for the line (paused, out of CPU budget until the next budget
    day, rate limited until T, at its cap) with its ETA; a line nothing holds back waits for a free
    worker (the next release or pull takes it). A line held up until a time (scheduling.holding.block)
    goes no earlier than that time. The ETA is None where no time is known (a run's end, a worker)."""
    state = Standing(
        cpu_limit_ms=status.cpu_limit_ms, max_concurrent=status.max_concurrent, usage_id=None,
        cpu_used_ms=status.cpu_used_ms, cpu_reserved_ms=status.cpu_reserved_ms,
        in_flight=status.running + status.sent, active=status.running, in_line=in_line,
        blocked=blocked_until > now, paused=paused, weight=status.weight, rate_starts=status.rate_starts,
        rate_period_s=status.rate_period_s, recent_starts=status.recent_starts)
    reason, eta = standing.refusal(state, now, pause=True) or (DeferReason.WORKERS_BUSY, None)
    if reason in ACCOUNT_WAITS_REASONS:
        return Wait(reason, max(eta, blocked_until))
    return Wait(reason, eta if reason == DeferReason.PAUSED else None)  # the others wait for a run's end or a worker


def line_waits(*, lines: set[tuple[int, str]]) -> dict[tuple[int, str], Wait]:
    """`line_wait` for each (account id, queue) line, read in one batch. A line of an account
    whose plan's Budget row on the queue is not made yet waits for a free worker: its first release
    makes the row."""
    if not lines:
        return {}
    now = clock.now()
    ids = {account_id for account_id, _ in lines}
    accounts = Account.objects.filter(pk__in=among(ids))
    slug_ids = dict(accounts.values_list("slug", "pk"))
    backlog = {(a, q): (n, until, why) for a, q, n, until, why in Backlog.objects.filter(
        account_id__in=among(ids)).values_list("account_id", "queue", "in_line", "blocked_until", "blocked_reason")}
    pauses = set(Pause.objects.filter(Q(account_id__in=among(ids)) | Q(account__isnull=True)).values_list("account_id", "queue"))
    waits = {}
    for status in budget_status(accounts=accounts):
        line = (slug_ids[status.account], status.queue)
        if line in lines:
            in_line, blocked_until, _ = backlog.get(line, (0, NOT_BLOCKED, ""))
            waits[line] = line_wait(status, in_line=in_line > 0, blocked_until=blocked_until, now=now,
                                    paused=bool({(line[0], ""), line, (None, line[1])} & pauses))
    for line in lines - set(waits):  # no Budget row yet: its line's block, if any, else a worker
        _, blocked_until, why = backlog.get(line, (0, NOT_BLOCKED, ""))
        waits[line] = (Wait(why or DeferReason.BUDGET_EXHAUSTED, blocked_until) if blocked_until > now
                       else Wait(DeferReason.WORKERS_BUSY, None))
    return waits
