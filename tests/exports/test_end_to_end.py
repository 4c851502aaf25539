"""Request -> real qcluster worker -> published file -> authorised download (PostgreSQL)."""
import csv
import datetime as dt
import hashlib
import io
from decimal import Decimal

import pytest

from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from scheduling.models import Outcome, TaskRun
from tests.exports.support import download, wait_finished, wait_runs_settled
from tests.factories import ActivityEventFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]


def _event(account, day: int, hour: int, **kw):
    return ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 3, day, hour, tzinfo=dt.UTC), **kw)


@pytest.mark.parametrize(
    ("broker", "export_store"),
    [("orm", "local"), ("redis", "local"), ("rabbitmq", "local"), ("orm", "s3"), ("redis", "s3")],
    indirect=True, ids=["orm-local", "redis-local", "rabbitmq-local", "orm-s3", "redis-s3"])
def test_export_runs_through_a_real_worker_and_downloads_exactly_the_accounts_range(
    account, other_account, owner, start_cluster, broker, export_store,
):
    inside = [
        _event(account, 2, 0, description="first of the range"),
        _event(account, 3, 12, amount=Decimal("-7.25"), description='quote " comma , newline\nend'),
        _event(account, 4, 23, description='=HYPERLINK("http://evil.example","x")'),
    ]
    _event(account, 1, 23, description="the day before")          # outside the range
    _event(account, 5, 0, description="the day after")            # outside the range
    _event(other_account, 3, 12, description="someone else's row")  # other account
    cluster = start_cluster("exports", **broker.env, **export_store.env)

    record, created = export_request(
        account_slug="acme", user=owner, start=dt.date(2026, 3, 2), end=dt.date(2026, 3, 4),
    )
    assert created

    wait_finished(record, cluster)  # on a timeout, fails with the worker's log as it is then
    assert record.status == ExportStatus.SUCCEEDED, (record.error_class, record.error_message, cluster.log())

    _, body = download(owner, record)

    rows = list(csv.reader(io.StringIO(body.decode())))
    assert rows[0] == ["occurred_at", "actor_email", "event_type", "amount", "description"]
    assert rows[1:] == [
        [e.occurred_at.strftime("%Y-%m-%dT%H:%M:%SZ"), e.actor_email, e.event_type, str(e.amount),
         e.description if not e.description.startswith("=") else "'" + e.description]
        for e in inside
    ]
    assert record.row_count == 3
    assert record.byte_size == len(body)
    assert record.checksum_sha256 == hashlib.sha256(body).hexdigest()
    assert record.output_key == f"exports/{account.pk}/{record.pk}.csv"
    assert export_store.files() == [record.output_key, record.output_key + ".manifest.json"]

    # The export is complete before the runner finishes writing its TaskRun: wait for that too.
    wait_runs_settled(record, cluster)
    run = TaskRun.objects.get(job="exports.build", ref=str(record.pk))
    assert run.outcome == Outcome.SUCCEEDED, (run.error_class, run.error_message)
    assert run.items == 3 and run.account_id == account.pk
    attempt = record.attempts.get()
    assert attempt.outcome == "succeeded" and attempt.task_run_id == run.pk


def test_idempotency_key_gives_one_export_even_for_concurrent_requests(account, owner):
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connections

    def request(_):
        try:
            record, created = export_request(
                account_slug="acme", user=owner, start=dt.date(2026, 3, 1), end=dt.date(2026, 3, 31),
                idempotency_key="nightly-2026-03",
            )
            return record.pk, created
        finally:
            connections.close_all()

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(request, range(8)))
    assert len({pk for pk, _ in results}) == 1
    assert sum(created for _, created in results) == 1
    assert ExportRecord.objects.filter(account=account).count() == 1
