"""Streaming an export source into a CSV file in bounded batches.

Three read strategies, one output:
- ``copy``: PostgreSQL renders the CSV itself (`COPY (SELECT …) TO STDOUT (FORMAT csv)`), the
  fastest path (see bench/export_throughput.py);
- ``cursor``: a PostgreSQL server-side cursor, rows rendered in Python;
- ``orm``: Django's `QuerySet.iterator()`, for SQLite (the demo) and any other database.

Every cell is quoted (`FORCE_QUOTE *` / `QUOTE_ALL`), lines end in ``\\n``, text is UTF-8, and
`exports.sources` renders each column kind identically in SQL and in Python — so the three
strategies produce byte-identical files (tested).

PostgreSQL reads use a second, private connection: the task's own connection stays free for
the progress and lease writes made between batches while COPY is still streaming.
"""
import contextlib
import csv
import hashlib
import io
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

from exports.sources import ExportSource, cell_sql, format_cell
from scheduling.metering import Meter

STRATEGIES = ("copy", "cursor", "orm")
FLUSH_BYTES = 1 << 20  # buffer output in ~1 MiB writes


@dataclass(frozen=True)
class CsvResult:
    rows: int
    byte_size: int
    sha256: str


class HashingWriter:
    """Writes through to a binary file, keeping a running SHA-256 and byte count."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.hash = hashlib.sha256()
        self.byte_size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.hash.update(data)
        self.byte_size += len(data)
        self.raw.write(data)


def resolve_strategy(strategy: str | None = None) -> str:
    strategy = strategy or settings.FAIRSHARE["EXPORT_STREAM"]
    is_postgres = connections[DEFAULT_DB_ALIAS].vendor == "postgresql"
    if strategy == "auto":
        return "copy" if is_postgres else "orm"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown export stream strategy {strategy!r}; choose from {STRATEGIES}")
    if strategy != "orm" and not is_postgres:
        raise ValueError(f"the {strategy!r} strategy needs PostgreSQL")
    return strategy


def line_renderer():
    """A function that renders rows as the export's CSV lines (every cell quoted), as bytes."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, quoting=csv.QUOTE_ALL, lineterminator="\n")

    def render(rows: Iterable[Iterable[str]]) -> bytes:
        writer.writerows(rows)
        data = buffer.getvalue().encode()
        buffer.seek(0)
        buffer.truncate()
        return data

    return render


def stream_csv(
    *,
    source: ExportSource,
    account_id: int,
    since,
    until,
    out: BinaryIO,
    meter: Meter,
    on_batch: Callable[[int], None] = lambda rows: None,
    strategy: str | None = None,
    batch_rows: int | None = None,
) -> CsvResult:
    """Write the header and every row of the source's range to `out`.

    `on_batch(rows_so_far)` runs between batches: the caller's place to report progress, renew
    its lease and honour cancellation (by raising).
    """
    batch_rows = batch_rows or settings.FAIRSHARE["EXPORT_BATCH_ROWS"]
    writer = HashingWriter(out)
    render = line_renderer()
    writer.write(render([source.header]))
    queryset = source.queryset(account_id=account_id, since=since, until=until)
    strategy = resolve_strategy(strategy)
    if strategy == "orm":
        rows = _stream_formatted(source, meter.db_reads(_orm_batches(queryset, batch_rows)), writer, render, on_batch)
    else:
        with _reader_connection() as pg:
            if strategy == "copy":
                rows = _stream_copy(source, queryset, pg, writer, meter, on_batch, batch_rows)
            else:
                batches = _cursor_batches(queryset, pg, batch_rows)
                rows = _stream_formatted(source, meter.db_reads(batches), writer, render, on_batch)
    return CsvResult(rows=rows, byte_size=writer.byte_size, sha256=writer.hash.hexdigest())


@contextlib.contextmanager
def _reader_connection():
    reader = connections.create_connection(DEFAULT_DB_ALIAS)
    try:
        reader.ensure_connection()
        yield reader.connection  # the raw psycopg connection
    finally:
        reader.close()


def copy_statement(source: ExportSource, queryset) -> tuple[str, tuple]:
    """The COPY … TO STDOUT statement (and its parameters) that the "copy" strategy sends: the
    source's cells, rendered by PostgreSQL as the export's CSV."""
    inner_sql, params = queryset.query.sql_with_params()
    names = [f"c{i}" for i in range(len(source.columns))]
    cells = ", ".join(cell_sql(col.kind, name) for col, name in zip(source.columns, names))
    sql = (
        f"COPY (SELECT {cells} FROM ({inner_sql}) AS src({', '.join(names)})) "
        "TO STDOUT (FORMAT csv, FORCE_QUOTE *)"
    )
    return sql, params


def _stream_copy(source, queryset, pg, writer, meter, on_batch, batch_rows) -> int:
    sql, params = copy_statement(source, queryset)
    rows = 0
    with pg.cursor() as cur, cur.copy(sql, params) as copy:
        # Metered per chunk, not per row: a per-row wrapper cost ~0.4 s of CPU per million rows,
        # a fifth of the worker's CPU for the whole export (bench/export_throughput.py).
        for chunk, rows in meter.db_reads(_copy_chunks(copy, batch_rows)):
            writer.write(chunk)
            if rows % batch_rows == 0:
                on_batch(rows)
    return rows


def _copy_chunks(copy, batch_rows) -> Iterator[tuple[bytearray, int]]:
    """The COPY output as (chunk, rows so far): a chunk ends at ~FLUSH_BYTES or at a batch's end.

    In COPY TO, PostgreSQL sends one CopyData message per row and psycopg returns one message
    per read: counting reads counts rows, even with newlines in cells.
    """
    read = copy.read
    rows = 0
    pending = bytearray()
    while data := read():
        pending += data
        rows += 1
        if rows % batch_rows == 0 or len(pending) >= FLUSH_BYTES:
            yield pending, rows
            pending.clear()  # the caller has written it by the time it asks for more
    if pending:
        yield pending, rows


def _cursor_batches(queryset, pg, batch_rows) -> Iterator[list[tuple]]:
    sql, params = queryset.query.sql_with_params()
    # A named (server-side) cursor lives inside a transaction; rows arrive `batch_rows` at a time.
    with pg.transaction(), pg.cursor(name="fairshare_export") as cur:
        cur.itersize = batch_rows
        cur.execute(sql, params)
        while batch := cur.fetchmany(batch_rows):
            yield batch


def _orm_batches(queryset, batch_rows) -> Iterator[list[tuple]]:
    batch = []
    for row in queryset.iterator(chunk_size=batch_rows):
        batch.append(row)
        if len(batch) == batch_rows:
            yield batch
            batch = []
    if batch:
        yield batch


def _stream_formatted(source, batches, writer, render, on_batch) -> int:
    kinds = [c.kind for c in source.columns]
    rows = 0
    for batch in batches:
        writer.write(render([format_cell(k, v) for k, v in zip(kinds, row)] for row in batch))
        rows += len(batch)
        on_batch(rows)
    return rows
