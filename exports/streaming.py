"""Streaming an export source into a CSV file in bounded batches.

Three read strategies, one output:
- ``copy``: PostgreSQL renders the CSV itself (`COPY (SELECT …) TO STDOUT (FORMAT csv)`), the
  fastest path (see bench/export_throughput.py);
- ``cursor``: a PostgreSQL server-side cursor, rows rendered in Python;
- ``orm``: Django's `QuerySet.iterator()`, rows rendered in Python (the reference the others are
  tested against).

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
import select
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import psycopg
import psycopg.errors
from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections
from psycopg import pq

from exports.sources import ExportSource, cell_sql, format_cell
from scheduling.metering import Meter

STRATEGIES = ("copy", "cursor", "orm")
FLUSH_BYTES = 1 << 20  # buffer output in ~1 MiB writes
WAIT_INTERVAL_S = 0.1  # psycopg's own, for waits that must let signal handlers run


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
    if strategy == "auto":
        return "copy"
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown export stream strategy {strategy!r}; choose from {STRATEGIES}")
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
    # psycopg starts the COPY and, if the block is left early (on_batch raised), cancels it and
    # drains the rest; the rows themselves are read from libpq by _copy_chunks.
    with pg.cursor() as cur, cur.copy(sql, params):
        # Metered per chunk, not per row: a per-row wrapper cost ~0.4 s of CPU per million rows,
        # a fifth of the worker's CPU for the whole export (bench/export_throughput.py).
        for chunk, rows in meter.db_reads(_copy_chunks(pg, batch_rows)):
            writer.write(chunk)
            if rows % batch_rows == 0:
                on_batch(rows)
    return rows


def _copy_chunks(pg, batch_rows) -> Iterator[tuple[memoryview, int]]:
    """The COPY output as (chunk, rows so far): a chunk ends at a batch's end, or once it holds
    FLUSH_BYTES and libpq has no whole message left to give.

    In COPY TO, PostgreSQL sends one CopyData message per row (the protocol says "always one per
    row"), so counting messages counts rows, even with newlines in cells, and a batch ends exactly
    on a row. The messages are taken from libpq directly (non-blocking `PQgetCopyData`), not one
    `Copy.read()` each, whose wait-and-generator machinery cost ~0.35 s of CPU per million rows
    (half the stream's CPU), and gathered in one reused buffer (a bytearray emptied per chunk is
    given back to the allocator and faulted in again: ~0.07 s per million rows). Measured with
    bench/export_throughput.py's data set.
    """
    pgconn = pg.pgconn
    get_copy_data = pgconn.get_copy_data
    readable = _readable(pgconn)
    buffer = io.BytesIO()
    append = buffer.write
    rows = 0
    batch_end = batch_rows
    while True:
        nbytes, data = get_copy_data(1)
        if nbytes > 0:
            append(data)
            rows += 1
            if rows == batch_end:
                with _taken(buffer) as chunk:
                    yield chunk, rows
                batch_end += batch_rows
        elif nbytes == 0:  # no whole message buffered: hand over a full chunk, then read more
            if buffer.tell() >= FLUSH_BYTES:
                with _taken(buffer) as chunk:
                    yield chunk, rows
            readable()
            pgconn.consume_input()
        else:  # -1: the COPY is over (ended or failed); -2 raises in psycopg
            break
    _end_copy_out(pg, readable)
    if buffer.tell():
        with _taken(buffer) as chunk:
            yield chunk, rows


@contextlib.contextmanager
def _taken(buffer: io.BytesIO) -> Iterator[memoryview]:
    """What was written to `buffer` since it was last taken, as a view valid inside the block;
    then the buffer starts again from the beginning, keeping its memory."""
    with buffer.getbuffer() as whole, whole[:buffer.tell()] as chunk:
        yield chunk
    buffer.seek(0)


def _readable(pgconn) -> Callable[[], None]:
    """A wait for the connection's socket to have data. It wakes every WAIT_INTERVAL_S, as
    psycopg's own waits do, so a signal raised for the main thread (the CPU budget's
    `interrupt_main`) is handled while we wait."""
    poller = select.poll()
    poller.register(pgconn.socket, select.POLLIN | select.POLLERR | select.POLLHUP)
    timeout_ms = int(WAIT_INTERVAL_S * 1000)

    def wait() -> None:
        while not poller.poll(timeout_ms):
            pass

    return wait


def _end_copy_out(pg, readable) -> None:
    """Collect the COPY's final result as libpq's protocol requires (`PQgetResult` until there is
    none), leaving the connection idle; raise the server's error, as psycopg would, if it failed."""
    pgconn = pg.pgconn
    error = None
    while True:
        try:
            while pgconn.is_busy():
                readable()
                pgconn.consume_input()
        except psycopg.DatabaseError:
            # A server that ends the COPY with an error may close the connection before its last
            # message (a terminated backend, a shutdown): as in psycopg's own fetch, its error is
            # the one to report, not the closed connection.
            if error is None:
                raise
            break
        result = pgconn.get_result()
        if result is None:
            break
        if result.status != pq.ExecStatus.COMMAND_OK and error is None:
            error = psycopg.errors.error_from_result(result, encoding=pg.info.encoding)
    if error is not None:
        raise error


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
