"""Replay: the usage ledger rebuilt from the retained log (docs/usage-log.md "Replay").

The stream is read from a time or a sequence to its end as it was when the read began; each run
event's `charged` figures are summed per account, queue and budget day, each event id once (a
duplicate that reached the log after its window is still counted once). A day is rebuilt whole
only when the read starts before its first event: events are published after their effect, so a
read from the start of budget day D (in the budget zone) sees every event of D and of the days
after; the days before D are left out of the comparison.
"""
import asyncio
import datetime as dt
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

from django.conf import settings
from django.db import transaction

from budgets.models import UsageDay

# The ledger's columns a replay rebuilds, and the `charged` figure of an event each one sums.
COLUMNS = {"runs": "runs", "cpu_used_ms": "cpu_ms", "wall_ms": "wall_ms", "db_wait_ms": "db_wait_ms",
           "storage_wait_ms": "storage_wait_ms"}
Key = tuple[int, str, dt.date]  # account, queue, budget day
VERSION = 1  # the event format this replay reads (docs/usage-log.md)


class UnknownVersion(ValueError):
    """An event of a format this code does not know: summing it as version 1 could be wrong."""


@dataclass
class Totals:
    runs: int = 0
    cpu_used_ms: int = 0
    wall_ms: int = 0
    db_wait_ms: int = 0
    storage_wait_ms: int = 0

    def add(self, charged: dict) -> None:
        for column, figure in COLUMNS.items():
            setattr(self, column, getattr(self, column) + int(charged.get(figure, 0)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Start:
    """Where a read starts: a time (`at`) or a stream sequence (`sequence`)."""

    at: dt.datetime | None = None
    sequence: int | None = None


@dataclass
class Rebuilt:
    first_day: dt.date | None  # the first day rebuilt whole (None: no run event read)
    totals: dict[Key, Totals] = field(default_factory=dict)
    events: int = 0  # run events read and counted
    duplicates: int = 0  # events whose id was read before


def rebuild(events: Iterable[dict], *, first_day: dt.date | None, last_day: dt.date,
            account: int | None = None) -> Rebuilt:
    """Sum the run events' `charged` figures per account, queue and day within the days. Without
    `first_day` (a read from a sequence, which may start in the middle of a day), the first whole
    day is the one after the first run event's."""
    out = Rebuilt(first_day=first_day)
    seen: set[str] = set()
    for event in events:
        if event.get("v") != VERSION:
            raise UnknownVersion(f"event {event.get('id')} is of version {event.get('v')}; this replay reads "
                                 f"version {VERSION} (docs/usage-log.md)")
        if event.get("type") not in ("run.settled", "run.revived"):
            continue
        if event["id"] in seen:
            out.duplicates += 1
            continue
        seen.add(event["id"])
        day = dt.date.fromisoformat(event["day"])
        if out.first_day is None:
            out.first_day = first_day = day + dt.timedelta(days=1)
        if not first_day <= day <= last_day or (account is not None and event["account"] != account):
            continue
        out.events += 1
        out.totals.setdefault((event["account"], event["queue"], day), Totals()).add(event["charged"])
    return out


def ledger(*, first_day: dt.date, last_day: dt.date, account: int | None = None) -> dict[Key, Totals]:
    """The ledger's rows of those days (index usageday_day_account_queue)."""
    rows = UsageDay.objects.filter(day__gte=first_day, day__lte=last_day)
    if account is not None:
        rows = rows.filter(account_id=account)
    return {(r["account_id"], r["queue"], r["day"]): Totals(**{c: r[c] for c in COLUMNS})
            for r in rows.values("account_id", "queue", "day", *COLUMNS)}


def differences(rebuilt: dict[Key, Totals], recorded: dict[Key, Totals]) -> list[str]:
    """Every figure on which the ledger and the log differ, one line each, sorted."""
    lines = []
    for key in sorted(set(rebuilt) | set(recorded)):
        from_log, in_ledger = rebuilt.get(key, Totals()).as_dict(), recorded.get(key, Totals()).as_dict()
        for column in COLUMNS:
            if from_log[column] != in_ledger[column]:
                account, queue, day = key
                lines.append(f"account {account} queue {queue} day {day}: {column} ledger {in_ledger[column]} "
                             f"log {from_log[column]}")
    return lines


@transaction.atomic
def restore(rebuilt: dict[Key, Totals], *, first_day: dt.date, last_day: dt.date,
            account: int | None = None) -> int:
    """Write the rebuilt figures over the ledger's for those days (a row the log has nothing for
    gets zeros); reserved CPU, deferrals and cap hits are left as they are. Returns rows written.
    The caller makes sure no worker runs (a settlement meanwhile would be overwritten)."""
    written = 0
    for key in set(rebuilt) | set(ledger(first_day=first_day, last_day=last_day, account=account)):
        account_id, queue, day = key
        UsageDay.objects.update_or_create(account_id=account_id, queue=queue, day=day,
                                          defaults=rebuilt.get(key, Totals()).as_dict())
        written += 1
    return written


def read_stream(url: str, start: Start, *, account: int | None = None, batch: int = 1000) -> Iterator[dict]:
    """The stream's run events from `start` to its last message when the read began, decoded."""
    loop = asyncio.new_event_loop()
    reader = loop.run_until_complete(_Reader.open(url, start, account))
    try:
        while chunk := loop.run_until_complete(reader.next_chunk(batch)):
            for data in chunk:
                yield json.loads(data)
    finally:
        loop.run_until_complete(reader.close())
        loop.close()


class _Reader:
    """An ordered consumer (no acknowledgements, no state on the server after it) over the run
    subjects (one account's when given), from the start to the stream's last sequence at opening."""

    @classmethod
    async def open(cls, url: str, start: Start, account: int | None) -> "_Reader":
        from nats.js.api import ConsumerConfig, DeliverPolicy

        from usage.sinks import connect

        self = cls()
        conf = settings.FAIRSHARE
        self.nc = await connect(url)
        js = self.nc.jetstream()
        info = await js.stream_info(conf["USAGE_STREAM"])
        self.last = info.state.last_seq
        self.done = info.state.messages == 0
        subject = f"{conf['USAGE_SUBJECT_PREFIX']}.run." + (f"*.{account}" if account is not None else ">")
        if start.sequence is not None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start.sequence)
        elif start.at is not None:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME,
                                    opt_start_time=start.at.astimezone(dt.timezone.utc).isoformat())
        else:
            config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        self.sub = None if self.done else await js.subscribe(
            subject, stream=conf["USAGE_STREAM"], ordered_consumer=True, config=config, pending_msgs_limit=-1)
        return self

    async def next_chunk(self, batch: int) -> list[bytes]:
        chunk: list[bytes] = []
        while not self.done and len(chunk) < batch:
            try:
                msg = await self.sub.next_msg(timeout=2.0)
            except TimeoutError:
                # Nothing more on these subjects (the last messages are another subject's).
                self.done = True
                break
            chunk.append(msg.data)
            if msg.metadata.sequence.stream >= self.last:
                self.done = True
        return chunk

    async def close(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()
        await self.nc.close()
