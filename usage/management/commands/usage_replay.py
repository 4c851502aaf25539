"""manage.py usage_replay: rebuild accounts' daily usage from the retained log (docs/usage-log.md)."""
import datetime as dt
from zoneinfo import ZoneInfo

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from budgets import clock
from scheduling.models import WorkerHeartbeat
from usage import replay
from usage.models import UsageEvent


def parse_start(raw: str) -> tuple[replay.Start, dt.date | None]:
    """`seq:N`, a budget day (YYYY-MM-DD: from its start in the budget zone) or an ISO time; with
    the first budget day the read is complete for."""
    if raw.startswith("seq:"):
        return replay.Start(sequence=int(raw[4:])), None  # the day after the first event's (replay.rebuild)
    try:
        day = dt.date.fromisoformat(raw)
    except ValueError:
        at = dt.datetime.fromisoformat(raw)
        at = at if at.tzinfo else at.replace(tzinfo=dt.timezone.utc)
        return replay.Start(at=at), clock.budget_day(at) + dt.timedelta(days=1)
    zone = ZoneInfo(settings.FAIRSHARE["BUDGET_DAY_TIMEZONE"])
    return replay.Start(at=dt.datetime.combine(day, dt.time.min, tzinfo=zone)), day


class Command(BaseCommand):
    help = ("Read the usage log (the NATS JetStream stream) from a time or a sequence and rebuild each account's "
            "daily usage (runs, CPU used, wall time, waits) from its run events. --check prints every difference "
            "from the ledger (UsageDay) and exits 1 if there is one; --restore writes the rebuilt figures over the "
            "ledger's, and refuses while a worker is running or events wait in the outbox.")

    def add_arguments(self, parser):
        parser.add_argument("--since", required=True,
                            help="where to start reading: a budget day YYYY-MM-DD (from its first instant in the "
                                 "budget zone), an ISO time, or seq:N (a stream sequence: from the day after its "
                                 "first event's). Days before the first whole one read are not compared")
        parser.add_argument("--until", type=dt.date.fromisoformat,
                            help="the last budget day to rebuild, YYYY-MM-DD (default: today's)")
        parser.add_argument("--account", type=int, help="only this account (its id)")
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--check", action="store_true", help="compare with the ledger, print every difference")
        mode.add_argument("--restore", action="store_true", help="write the rebuilt figures into the ledger")

    def handle(self, *args, since: str, until: dt.date | None, account: int | None, check: bool, restore: bool,
               **options):
        url = settings.FAIRSHARE["USAGE_NATS_URL"]
        if not url:
            raise CommandError("FAIRSHARE_USAGE_NATS_URL is not set: there is no usage log to read")
        start, first_day = parse_start(since)
        last_day = until or clock.budget_day()
        waiting = UsageEvent.objects.count()
        if restore:
            self._refuse_while_running(waiting)
        try:
            rebuilt = replay.rebuild(replay.read_stream(url, start, account=account), first_day=first_day,
                                     last_day=last_day, account=account)
        except OSError as exc:
            raise CommandError(f"NATS is unavailable: {exc}") from exc
        except replay.UnknownVersion as exc:
            raise CommandError(str(exc)) from exc
        first_day = rebuilt.first_day
        if first_day is None:  # read from a sequence, and no run event there
            self.stdout.write("no run event read: nothing to rebuild")
            return
        span = f"{first_day} to {last_day}"
        self.stdout.write(f"read {rebuilt.events} run events ({rebuilt.duplicates} duplicates dropped), "
                          f"days {span}, {len(rebuilt.totals)} account-queue-days")
        if waiting:
            self.stdout.write(f"note: {waiting} events wait in the outbox, not yet in the log")
        if restore:
            written = replay.restore(rebuilt.totals, first_day=first_day, last_day=last_day, account=account)
            self.stdout.write(f"restored {written} usage rows")
        elif check:
            lines = replay.differences(rebuilt.totals, replay.ledger(first_day=first_day, last_day=last_day,
                                                                     account=account))
            for line in lines:
                self.stdout.write(line)
            self.stdout.write(f"{len(lines)} differences")
            if lines:
                raise SystemExit(1)
        else:
            for (acc, queue, day), totals in sorted(rebuilt.totals.items()):
                figures = " ".join(f"{k}={v}" for k, v in totals.as_dict().items())
                self.stdout.write(f"account {acc} queue {queue} day {day}: {figures}")

    def _refuse_while_running(self, waiting: int) -> None:
        since = timezone.now() - dt.timedelta(seconds=settings.FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"])
        live = WorkerHeartbeat.objects.filter(seen_at__gte=since).count()
        if live:
            raise CommandError(f"{live} workers are running (heartbeats within "
                               f"{settings.FAIRSHARE['HEALTH_HEARTBEAT_MAX_AGE_S']} s): stop them before --restore, "
                               "or a settlement meanwhile would be overwritten")
        if waiting:
            raise CommandError(f"{waiting} events wait in the outbox: run usage_relay until it is empty first")
