"""Sample activity rows: the demo's (`seed_demo`), the rehearsal's, the benchmarks' and the tests'.

Rows are deterministic: row i of a seed is a function of (seed, i) alone, so the same call makes
the same data everywhere and a top-up (`first=` the rows already there) continues the series. A
call spreads its rows evenly over its time window, in time order, so rows written in one go lie
on disk in time order, as appended activity does.

Realistic rows carry the text an export must survive: commas, double quotes, newlines, tabs,
non-ASCII, and cells starting with `=`, `+`, `-` or `@` (spreadsheet formula triggers) in about a
quarter of the rows; e-mail addresses, dotted event types and amounts with negatives; about 120
bytes of CSV per row. Numbered rows are plain and predictable, for tests that check every row.
"""
import datetime as dt
import hashlib
from collections.abc import Callable, Iterable, Iterator
from decimal import Decimal

from django.db import connection


COLUMNS = ("account_id", "occurred_at", "actor_email", "event_type", "amount", "description")
Row = tuple[int, dt.datetime, str, str, Decimal, str]

FIRST_NAMES = ("ana", "bram", "chloe", "dev", "eve", "femke", "gus", "hana", "ivo", "jun", "kees", "lotte")
LAST_NAMES = ("devries", "jansen", "obrien", "smith", "muller", "nakamura", "garcia", "okafor")
DOMAINS = ("example.com", "acme.io", "mail.example.org", "globex.co.uk")
EVENT_TYPES = ("invoice.paid", "invoice.refunded", "user.login", "user.logout", "export.requested",
               "seat.added", "plan.changed", "payment.failed")
# Ten of twenty rows are plain invoices; each of the others is one awkward case.
AWKWARD = {
    10: lambda i, h: f'Refund for order #{i}, reason: "damaged in transit", ticket {h % 9999}',
    11: lambda i, h: f'Seat added for {("Ana", "Bram", "Chloé")[h % 3]} (role: "operator")',
    12: lambda i, h: f"\tindented memo {i}",
    13: lambda i, h: f'=HYPERLINK("http://evil.example/?q={i}","click me")',
    14: lambda i, h: f"+31 20 {h % 10_000_000:07d}",
    15: lambda i, h: '@team: see the "Q1, budget" sheet',
    16: lambda i, h: f"-{h % 500} credits adjusted",
    17: lambda i, h: "Note from support:\nsecond line, with a comma",
    18: lambda i, h: f"Café Zürich — naïve résumé, {h % 100} €",
    19: lambda i, h: "",
}


def _realistic(seed: str, i: int) -> tuple[str, str, Decimal, str, float]:
    """Row i's actor, event type, amount, description, and where in its time slot it falls."""
    h = int.from_bytes(hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=8).digest(), "big") >> 1
    actor = ("-" if h % 50 == 0 else "") + (
        f"{FIRST_NAMES[h % 12]}.{LAST_NAMES[(h // 12) % 8]}{h % 997}@{DOMAINS[(h // 96) % 4]}")
    amount = Decimal((h // 3072) % 2_000_001 - 400_000).scaleb(-2)
    awkward = AWKWARD.get((h // 7) % 20)
    description = awkward(i, h) if awkward else f"Invoice INV-{i:08d} paid via card ending {h % 10_000:04d}"
    return actor, EVENT_TYPES[(h // 384) % 8], amount, description, (h % 1000) / 1000


def _numbered(i: int) -> tuple[str, str, Decimal, str, float]:
    return f"actor{i}@example.com", "invoice.paid", Decimal(i % 100_000).scaleb(-2), f'row {i}, "quoted", =formula', 0.0


def activity_rows(*, account_id: int, count: int, since: dt.datetime, span_s: float, seed: str = "",
                  numbered: bool = False, first: int = 0) -> Iterator[Row]:
    """Rows first+1 … first+count of the series `seed`, in time order over [since, since + span_s).

    numbered: row i is "actor{i}@example.com", "invoice.paid", (i mod 100000) / 100,
    'row {i}, "quoted", =formula', at exactly since + (i - first - 1) * span_s / count.
    """
    slot_s = span_s / count if count else 0
    for k in range(count):
        i = first + k + 1
        actor, event_type, amount, description, offset = _numbered(i) if numbered else _realistic(seed, i)
        yield (account_id, since + dt.timedelta(seconds=(k + offset) * slot_s), actor, event_type, amount,
               description)


def insert_activity(rows: Iterable[Row], *, batch_rows: int = 5_000,
                    on_batch: Callable[[int], None] = lambda n: None) -> int:
    """Write `rows` (in COLUMNS order) in one COPY. `on_batch(n)` after every `batch_rows` rows and
    at the end. Returns the count."""
    written = pending = 0
    with connection.cursor() as cursor, cursor.copy(
        "COPY exports_activityevent (account_id, occurred_at, actor_email, event_type, amount, description) FROM STDIN"
    ) as copy:
        for row in rows:
            copy.write_row(row)
            written, pending = written + 1, pending + 1
            if pending == batch_rows:
                on_batch(pending)
                pending = 0
    if pending:
        on_batch(pending)
    return written


def add_activity(account, count: int, *, since: dt.datetime, span_s: float, seed: str | None = None,
                 numbered: bool = False, first: int = 0, on_batch: Callable[[int], None] = lambda n: None) -> int:
    """`count` rows for `account` (activity_rows, seeded by its slug unless `seed`), written by
    insert_activity."""
    rows = activity_rows(account_id=account.pk, count=count, since=since, span_s=span_s,
                         seed=account.slug if seed is None else seed, numbered=numbered, first=first)
    return insert_activity(rows, on_batch=on_batch)
