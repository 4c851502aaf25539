import json

from django.core.management.base import BaseCommand, CommandError

from budgets import clock
from budgets.models import Account, Budget
from budgets.selectors import budget_status
from budgets.waits import line_waits
from scheduling.models import Backlog, DeferReason
from scheduling.waits import eta_text

TOP = 50


class Command(BaseCommand):
    help = ("Today's budget per account and queue: CPU limit, used, reserved, remaining; running tasks, "
            "tasks sent to the broker and not started (each holds a slot too) and held tasks; its weight and "
            "rate limit with the starts in its window; what its line of held work waits for now and until when; and when the budget day resets. Without --account: the {TOP} budgets that used the most CPU today "
            "(--top N for another number, --all for every account, by slug).")

    def add_arguments(self, parser):
        parser.add_argument("--account", help="only this account (slug)")
        parser.add_argument("--top", type=int, default=TOP, help=f"how many budgets, by CPU used today (default {TOP})")
        parser.add_argument("--all", action="store_true", help="every account's budgets, by slug")
        parser.add_argument("--json", action="store_true", help="print JSON")

    def handle(self, *, account, top, **options):
        accounts = Account.objects.all()
        if account:
            accounts = accounts.filter(slug=account)
            if not accounts.exists():
                raise CommandError(f"No account {account!r}.")
        if top < 1:
            raise CommandError("--top must be at least 1.")
        rows = budget_status(accounts=accounts, top=None if account or options["all"] else top)
        waiting = _line_waits(rows)
        now = clock.now()
        labels = dict(DeferReason.choices)
        if options["json"]:
            self.stdout.write(json.dumps([
                {"account": r.account, "queue": r.queue, "day": r.day.isoformat(),
                 "cpu_limit_ms": r.cpu_limit_ms, "cpu_used_ms": r.cpu_used_ms, "cpu_reserved_ms": r.cpu_reserved_ms,
                 "cpu_remaining_ms": r.cpu_remaining_ms, "running": r.running, "sent": r.sent,
                 "max_concurrent": r.max_concurrent, "held": r.held, "weight": r.weight,
                 "rate_limit": None if r.rate_starts is None else {
                     "starts": r.rate_starts, "period_s": r.rate_period_s, "recent_starts": r.recent_starts,
                     "reached": r.rate_full},
                 "waiting": None if (r.account, r.queue) not in waiting else {
                     "in_line": waiting[(r.account, r.queue)][0],
                     "reason": labels[waiting[(r.account, r.queue)][1].reason],
                     "until": _until(waiting[(r.account, r.queue)][1], now)},
                 "next_reset": r.next_reset.isoformat()}
                for r in rows
            ], indent=2))
            return
        header = (f"{'account':<16} {'queue':<8} {'limit s':>9} {'used s':>9} {'reserved s':>10} {'left s':>9} "
                  f"{'running':>9} {'sent':>6} {'held':>6} {'weight':>6}  {'rate':<16}  in line waits for")
        self.stdout.write(header)
        for r in rows:
            self.stdout.write(
                f"{r.account:<16} {r.queue:<8} {r.cpu_limit_ms / 1000:>9.1f} {r.cpu_used_ms / 1000:>9.1f} "
                f"{r.cpu_reserved_ms / 1000:>10.1f} {r.cpu_remaining_ms / 1000:>9.1f} "
                f"{f'{r.running}/{r.max_concurrent}':>9} {r.sent:>6} {r.held:>6} {r.weight:>6}  {r.rate or '-':<16}  "
                f"{_waiting_text(waiting.get((r.account, r.queue)), labels, now)}"
            )
        if rows:
            self.stdout.write(f"budget day {rows[0].day}, next reset {rows[0].next_reset:%Y-%m-%d %H:%M %Z}")
        total = Budget.objects.filter(account__in=accounts).count()
        if len(rows) < total:
            self.stdout.write(f"the {len(rows)} of {total} budgets that used the most CPU today (--all for every one)")


def _line_waits(rows) -> dict:
    """(slug, queue) -> (jobs in line, what the line waits for now: budgets.waits) of the rows' lines
    with work in line: their Backlog rows by the account index, one standing per such line."""
    slugs = dict(Account.objects.filter(slug__in={r.account for r in rows}).values_list("pk", "slug"))
    in_line = {(account_id, queue): n for account_id, queue, n in Backlog.objects.filter(
        account_id__in=slugs, in_line__gt=0).values_list("account_id", "queue", "in_line")}
    waits = line_waits(lines=set(in_line))
    return {(slugs[account_id], queue): (n, waits[(account_id, queue)]) for (account_id, queue), n in in_line.items()}


def _until(wait, now) -> str | None:
    return None if wait.eta is None or wait.eta <= now else wait.eta.isoformat()


def _waiting_text(waiting, labels, now) -> str:
    if waiting is None:
        return "-"
    n, wait = waiting
    return f"{n}: {labels[wait.reason]}, {eta_text(wait, now)}"
