"""Export sources: what an export can be *of*.

A source maps an account and a date range to ordered columns and rows. It declares its columns
with a kind, and the kind decides how a value becomes a CSV cell — identically whether the rows
are formatted by PostgreSQL inside `COPY … TO STDOUT` or by Python from a cursor
(`exports.streaming` relies on both renderings being byte-for-byte the same).
"""
import datetime as dt
from dataclasses import dataclass
from enum import Enum

from django.db.models import QuerySet

from exports.models import ActivityEvent
from scheduling.models import TaskRun

# OWASP CSV injection: a cell starting with one of these may be run as a formula by a spreadsheet.
FORMULA_TRIGGERS = ("=", "+", "-", "@", "\t", "\r")


class Kind(Enum):
    TEXT = "text"
    TIMESTAMP = "timestamp"
    NUMBER = "number"  # integers and decimals: typed by the database, never formulas


@dataclass(frozen=True)
class Column:
    name: str
    field: str
    kind: Kind


def neutralise(value: str) -> str:
    """Prefix a would-be formula with an apostrophe so spreadsheets show it as text."""
    return "'" + value if value.startswith(FORMULA_TRIGGERS) else value


def format_cell(kind: Kind, value) -> str:
    if value is None:
        return ""
    if kind is Kind.TEXT:
        return neutralise(value)
    if kind is Kind.TIMESTAMP:
        return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


def cell_sql(kind: Kind, column: str) -> str:
    """The SQL that renders `column` exactly as `format_cell` does (PostgreSQL)."""
    if kind is Kind.TEXT:
        triggers = ", ".join(f"chr({ord(c)})" for c in FORMULA_TRIGGERS)
        return f"CASE WHEN left({column}, 1) IN ({triggers}) THEN chr(39) || {column} ELSE coalesce({column}, '') END"
    if kind is Kind.TIMESTAMP:
        return f"""coalesce(to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), '')"""
    return f"coalesce({column}::text, '')"


class ExportSource:
    name: str
    label: str
    columns: tuple[Column, ...]

    def base_queryset(self, *, account_id: int, since: dt.datetime, until: dt.datetime) -> QuerySet:
        """The account's rows in [since, until), in a stable order."""
        raise NotImplementedError

    def queryset(self, *, account_id: int, since: dt.datetime, until: dt.datetime) -> QuerySet:
        qs = self.base_queryset(account_id=account_id, since=since, until=until)
        return qs.values_list(*(c.field for c in self.columns))

    @property
    def header(self) -> list[str]:
        return [c.name for c in self.columns]


class ActivitySource(ExportSource):
    name = "activity"
    label = "Account activity"
    columns = (
        Column("occurred_at", "occurred_at", Kind.TIMESTAMP),
        Column("actor_email", "actor_email", Kind.TEXT),
        Column("event_type", "event_type", Kind.TEXT),
        Column("amount", "amount", Kind.NUMBER),
        Column("description", "description", Kind.TEXT),
    )

    def base_queryset(self, *, account_id, since, until):
        return ActivityEvent.objects.filter(
            account_id=account_id, occurred_at__gte=since, occurred_at__lt=until,
        ).order_by("occurred_at", "id")


class UsageSource(ExportSource):
    name = "usage"
    label = "Task runs (usage)"
    columns = (
        Column("started_at", "started_at", Kind.TIMESTAMP),
        Column("job", "job", Kind.TEXT),
        Column("queue", "queue", Kind.TEXT),
        Column("outcome", "outcome", Kind.TEXT),
        Column("cpu_ms", "cpu_ms", Kind.NUMBER),
        Column("wall_ms", "wall_ms", Kind.NUMBER),
        Column("db_wait_ms", "db_wait_ms", Kind.NUMBER),
        Column("storage_wait_ms", "storage_wait_ms", Kind.NUMBER),
        Column("items", "items", Kind.NUMBER),
    )

    def base_queryset(self, *, account_id, since, until):
        return TaskRun.objects.filter(
            account_id=account_id, started_at__gte=since, started_at__lt=until,
        ).order_by("started_at", "id")


SOURCES: dict[str, ExportSource] = {s.name: s for s in (ActivitySource(), UsageSource())}


class UnknownSource(LookupError):
    pass


def get_source(name: str) -> ExportSource:
    try:
        return SOURCES[name]
    except KeyError:
        raise UnknownSource(f"unknown export source {name!r}; known: {', '.join(sorted(SOURCES))}") from None


# The dates an export may cover: any day a report can hold, far enough from the calendar's ends
# that the day arithmetic (`end + 1 day`, ranges, local periods) cannot overflow.
EARLIEST_DATE = dt.date(1970, 1, 1)
LATEST_DATE = dt.date(2999, 12, 31)


def day_bounds(start: dt.date, end: dt.date) -> tuple[dt.datetime, dt.datetime]:
    """Inclusive UTC dates -> the half-open instant range [start 00:00, day after end 00:00)."""
    since = dt.datetime.combine(start, dt.time.min, tzinfo=dt.UTC)
    until = dt.datetime.combine(end + dt.timedelta(days=1), dt.time.min, tzinfo=dt.UTC)
    return since, until
