"""The three read strategies write byte-identical, formula-safe CSV (SPEC §4 Exports).

transaction=True: "copy" and "cursor" read through a second database connection, which sees only
committed rows.
"""
import csv
import datetime as dt
import hashlib
import io
from decimal import Decimal

import psycopg.errors
import pytest

from exports import streaming
from exports.sources import day_bounds, get_source
from exports.streaming import STRATEGIES, stream_csv
from scheduling.metering import Meter
from scheduling.models import TaskRun
from tests.factories import ActivityEventFactory

pytestmark = pytest.mark.django_db(transaction=True)

MARCH = day_bounds(dt.date(2026, 3, 1), dt.date(2026, 3, 31))
ACTIVITY_HEADER = ["occurred_at", "actor_email", "event_type", "amount", "description"]
# Every OWASP formula trigger, as a spreadsheet user would type it.
FORMULAS = ["=SUM(A1:A9)", "+1+1", "-1+1", "@SUM(A1)", "\tindented", "\rreturn"]


class StopExport(Exception):
    pass


def _expected_cell(text: str) -> str:
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _stream(account, *, strategy, source="activity", since_until=MARCH, **kwargs):
    out = io.BytesIO()
    since, until = since_until
    result = stream_csv(source=get_source(source), account_id=account.pk, since=since, until=until, out=out,
                        meter=Meter(), strategy=strategy, **kwargs)
    return result, out.getvalue()


def _parse(data: bytes) -> list[list[str]]:
    return list(csv.reader(io.StringIO(data.decode("utf-8"), newline="")))


@pytest.fixture
def awkward_events(account, other_account):
    """Rows that break naive CSV writers, in the order the export must list them."""
    start = dt.datetime(2026, 3, 2, 8, 30, 15, 999_999, tzinfo=dt.UTC)
    specs = [
        {"description": 'He said "hi", then left'},
        {"description": "two\nlines"},
        {"description": "windows\r\nlines"},
        {"description": "\tleading tab"},
        {"actor_email": "zoë@exämple.com", "description": "Crème brûlée — 日本語 🚀"},
        {"amount": Decimal("-7.25"), "description": "refund"},
        {"amount": Decimal("0.00"), "description": ""},
        {"amount": Decimal("-0.01"), "description": "a=b, c+d stays as it is"},
        {"amount": Decimal("1234567890.12"), "description": "'already quoted"},
        {"event_type": "=cmd|' /C calc'!A0", "actor_email": "@attacker.example"},
        *({"description": formula} for formula in FORMULAS),
    ]
    events = [
        ActivityEventFactory(account=account, occurred_at=start + dt.timedelta(hours=i), **spec)
        for i, spec in enumerate(specs)
    ]
    ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 4, 1, tzinfo=dt.UTC), description="April")
    ActivityEventFactory(account=other_account, occurred_at=start, description="=someone else's")
    return events


def test_strategies_write_byte_identical_csv(account, awkward_events):
    outputs = {strategy: _stream(account, strategy=strategy) for strategy in STRATEGIES}

    copy_result, copy_bytes = outputs["copy"]
    for strategy, (result, data) in outputs.items():
        assert data == copy_bytes, f"{strategy} differs from copy"
        assert result.sha256 == hashlib.sha256(data).hexdigest() == copy_result.sha256
        assert result.byte_size == len(data)
        assert result.rows == len(awkward_events)

    assert copy_bytes.startswith(b'"occurred_at","actor_email","event_type","amount","description"\n')
    assert b'"windows\r\nlines"' in copy_bytes  # embedded line breaks are kept, inside quotes


def test_csv_round_trips_the_values_with_formulas_neutralised(account, awkward_events):
    _, data = _stream(account, strategy="copy")
    rows = _parse(data)
    assert rows[0] == ACTIVITY_HEADER
    assert rows[1:] == [
        [
            event.occurred_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            _expected_cell(event.actor_email),
            _expected_cell(event.event_type),
            str(event.amount),
            _expected_cell(event.description),
        ]
        for event in awkward_events
    ]


def test_formula_cells_get_an_apostrophe_and_numbers_do_not(account, awkward_events):
    for strategy in STRATEGIES:
        rows = _parse(_stream(account, strategy=strategy)[1])[1:]
        descriptions = [row[4] for row in rows]
        for formula in FORMULAS:
            assert "'" + formula in descriptions, (strategy, formula)
            assert formula not in descriptions, (strategy, formula)
        refund = next(row for row in rows if row[4] == "refund")
        assert refund[3] == "-7.25"
        assert [row[3] for row in rows if row[4] == "a=b, c+d stays as it is"] == ["-0.01"]
        injected = next(row for row in rows if row[2].startswith("'="))
        assert injected[1:3] == ["'@attacker.example", "'=cmd|' /C calc'!A0"]
        assert "''already quoted" not in descriptions and "'already quoted" in descriptions


def test_empty_range_writes_only_the_header(account, awkward_events):
    empty = day_bounds(dt.date(2025, 1, 1), dt.date(2025, 1, 31))
    for strategy in STRATEGIES:
        result, data = _stream(account, strategy=strategy, since_until=empty)
        assert _parse(data) == [ACTIVITY_HEADER]
        assert result.rows == 0


@pytest.fixture
def five_events(account):
    return ActivityEventFactory.create_batch(5, account=account)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_on_batch_reports_progress_between_batches(account, five_events, strategy):
    calls: list[int] = []
    result, data = _stream(account, strategy=strategy, batch_rows=2, on_batch=calls.append)
    assert result.rows == 5 and len(_parse(data)) == 6
    # Every two rows; a report after the last, partial batch is allowed but not required.
    assert calls in ([2, 4], [2, 4, 5])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_exception_in_on_batch_stops_the_stream(account, five_events, strategy):
    _, complete = _stream(account, strategy=strategy, batch_rows=2)

    calls: list[int] = []

    def cancel(rows_so_far: int) -> None:
        calls.append(rows_so_far)
        raise StopExport

    out = io.BytesIO()
    with pytest.raises(StopExport):
        stream_csv(source=get_source("activity"), account_id=account.pk, since=MARCH[0], until=MARCH[1], out=out,
                   meter=Meter(), strategy=strategy, batch_rows=2, on_batch=cancel)
    assert calls == [2]
    partial = out.getvalue()
    assert _parse(partial) == _parse(complete)[:3]  # the header and the first batch, nothing after
    assert complete.startswith(partial)

    # The next export on this process is unaffected by the abandoned read.
    result, again = _stream(account, strategy=strategy, batch_rows=2)
    assert again == complete and result.rows == 5


def _task_run(account, started_at, **kwargs):
    defaults = {"job": "exports.build", "queue": "exports", "outcome": "succeeded", "cpu_ms": 120, "wall_ms": 300,
                "db_wait_ms": 40, "storage_wait_ms": 5, "items": 10}
    return TaskRun.objects.create(account=account, started_at=started_at, **{**defaults, **kwargs})


def test_usage_source_exports_only_the_accounts_task_runs(account, other_account):
    mine = [
        _task_run(account, dt.datetime(2026, 3, 1, 0, 0, tzinfo=dt.UTC), job="exports.build", items=3),
        _task_run(account, dt.datetime(2026, 3, 31, 23, 59, 59, tzinfo=dt.UTC), job="scheduling.purge_expired_exports",
                  queue="default", outcome="failed", cpu_ms=0),
    ]
    _task_run(other_account, dt.datetime(2026, 3, 15, tzinfo=dt.UTC), job="globex.secret")
    _task_run(None, dt.datetime(2026, 3, 15, tzinfo=dt.UTC), job="scheduling.maintenance")
    _task_run(account, dt.datetime(2026, 4, 1, tzinfo=dt.UTC), job="too.late")
    _task_run(account, dt.datetime(2026, 2, 28, 23, 59, 59, tzinfo=dt.UTC), job="too.early")

    outputs = {strategy: _stream(account, strategy=strategy, source="usage") for strategy in STRATEGIES}
    assert len({data for _, data in outputs.values()}) == 1  # byte-identical across strategies
    result, data = outputs["copy"]
    assert result.rows == 2
    assert _parse(data) == [
        ["started_at", "job", "queue", "outcome", "cpu_ms", "wall_ms", "db_wait_ms", "storage_wait_ms", "items"],
        *[
            [run.started_at.strftime("%Y-%m-%dT%H:%M:%SZ"), run.job, run.queue, run.outcome, str(run.cpu_ms),
             str(run.wall_ms), str(run.db_wait_ms), str(run.storage_wait_ms), str(run.items)]
            for run in mine
        ],
    ]


def test_a_copy_that_fails_part_way_raises_the_servers_error(account, five_events, monkeypatch):
    """PostgreSQL has sent thousands of rows when the statement fails: the export fails with the
    server's error; it never ends as a shorter file reported whole."""
    failing = "COPY (SELECT 'row ' || (100000 / (50000 - g)) FROM generate_series(1, 60000) AS g) TO STDOUT (FORMAT csv)"
    monkeypatch.setattr(streaming, "copy_statement", lambda source, queryset: (failing, ()))
    calls: list[int] = []
    with pytest.raises(psycopg.errors.DivisionByZero):
        _stream(account, strategy="copy", batch_rows=1000, on_batch=calls.append)
    assert calls and calls[-1] < 50_000

    monkeypatch.undo()  # the next export on this process is unaffected
    result, data = _stream(account, strategy="copy")
    assert result.rows == 5 and len(_parse(data)) == 6
