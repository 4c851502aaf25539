"""Helpers shared by the export tests: report data, and what a user would see."""
import csv
import datetime as dt
import hashlib
import io
import json
from pathlib import Path

import pytest
from django.test import Client
from django.utils import timezone

from budgets.models import ApiToken, Membership
from budgets.reclaim import reclaim_expired
from exports.models import ExportRecord, ExportStatus
from exports.requests import BUILD_JOB
from exports.sample_data import add_activity
from scheduling.models import Outcome, TaskRun
from tests.conftest import wait_for
from tests.factories import AccountFactory
from tests.stores import LocalStore, S3Store

# Every test exports March 2026 of the account "acme".
RANGE = {"start": dt.date(2026, 3, 1), "end": dt.date(2026, 3, 31)}


def add_events(account, count: int) -> None:
    """`count` activity rows for the account, one a second from 1 March 2026 00:00:01: row i is
    actor{i}@example.com, invoice.paid, (i mod 100000) / 100, 'row {i}, "quoted", =formula'."""
    add_activity(account, count, since=dt.datetime(2026, 3, 1, 0, 0, 1, tzinfo=dt.UTC), span_s=count, numbered=True)


def bearer(user, account=None) -> dict:
    """Request headers that authenticate as `user` with a fresh API token for `account` (default:
    the user's first account)."""
    if account is None:
        first = Membership.objects.filter(user=user).order_by("pk").first()
        account = first.account if first else AccountFactory(slug=f"{user.username}-own")
    _, raw = ApiToken.issue(user=user, account=account, name="test")
    return {"HTTP_AUTHORIZATION": f"Bearer {raw}"}


def download(user, record: ExportRecord):
    """Signed in as `user`, follow the export's download link and read the whole file.

    Returns the file's response (closed) and its body."""
    client = Client()
    client.force_login(user)
    link = client.get(f"/api/exports/{record.pk}/download/")
    assert link.status_code == 302
    response = client.get(link["Location"])
    assert response.status_code == 200
    body = b"".join(response.streaming_content)
    response.close()
    return response, body


def object_key(record: ExportRecord) -> str:
    return f"exports/{record.account_id}/{record.pk}.csv"


def store_of(where: Path | LocalStore | S3Store) -> LocalStore | S3Store:
    """An export root folder (the default store) or an `export_store`."""
    return LocalStore(where) if isinstance(where, Path) else where


def stored_files(where) -> list[str]:
    """Every stored object (file under the export root, or S3 object), as sorted keys."""
    return store_of(where).files()


def file_ids(where, names: list[str]) -> dict[str, object]:
    """An identity of each object's stored version: unchanged means nobody wrote it again."""
    return store_of(where).ids(names)


def notifications(mail_dir: Path, record: ExportRecord) -> int:
    """How many "your export is ready" messages about this export were sent."""
    needle = f"Export {record.pk} (".encode()
    return sum(p.read_bytes().count(needle) for p in mail_dir.iterdir() if p.is_file())


def notification_ids(mail_dir: Path, record: ExportRecord) -> int:
    """How many of the messages sent carry this export's Message-ID (exports.notify)."""
    needle = f"Message-ID: <export-ready-{record.pk}@fairshare>".encode()
    return sum(p.read_bytes().count(needle) for p in mail_dir.iterdir() if p.is_file())


def runs(record: ExportRecord) -> list[str]:
    """Outcomes of the export job's runs, oldest first."""
    return list(TaskRun.objects.filter(job=BUILD_JOB, ref=str(record.pk)).order_by("started_at", "id")
                .values_list("outcome", flat=True))


def attempts(record: ExportRecord) -> list[str]:
    return list(record.attempts.order_by("number").values_list("outcome", flat=True))


def wait_logged(cluster, predicate, *, timeout: float, message: str):
    """`wait_for`, failing with the worker's log as it is when the wait fails."""
    try:
        return wait_for(predicate, timeout=timeout, message=message)
    except pytest.fail.Exception as failure:
        pytest.fail(f"{failure}\nworker log (end):\n{cluster.log()[-8000:]}")


def wait_finished(record: ExportRecord, cluster, *, timeout: float = 60) -> ExportRecord:
    def finished():
        record.refresh_from_db()
        return record.is_finished

    wait_logged(cluster, finished, timeout=timeout, message=f"export {record.pk} to finish")
    return record


def wait_runs_settled(record: ExportRecord, cluster, *, timeout: float = 30) -> list[str]:
    """Wait until no run of this export is still going; returns the runs' outcomes."""
    def settled():
        outcomes = runs(record)
        return outcomes if Outcome.RUNNING not in outcomes else None

    return wait_logged(cluster, settled, timeout=timeout, message=f"runs of {record.pk} to settle")


def lease_expired(record: ExportRecord) -> bool:
    return ExportRecord.objects.filter(
        pk=record.pk, status=ExportStatus.RUNNING, lease_expires_at__lt=timezone.now(),
    ).exists()


def assert_published_once(record: ExportRecord, root, *, rows: int) -> bytes:
    """The user-visible result: succeeded with the right rows and checksum, exactly one object
    under the export's key (plus its manifest), and the file is whole."""
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED, (record.status, record.error_class, record.error_message)
    key = object_key(record)
    assert record.output_key == key
    assert stored_files(root) == [key, key + ".manifest.json"]
    body = store_of(root).read(key)
    assert record.checksum_sha256 == hashlib.sha256(body).hexdigest()
    assert record.byte_size == len(body)
    assert record.row_count == rows
    lines = list(csv.reader(io.StringIO(body.decode())))
    assert lines[0] == ["occurred_at", "actor_email", "event_type", "amount", "description"]
    assert len(lines) == rows + 1
    assert [line[1] for line in lines[1:]] == [f"actor{i}@example.com" for i in range(1, rows + 1)]
    manifest = json.loads(store_of(root).read(key + ".manifest.json"))
    assert manifest == {"export_id": str(record.pk), "sha256": record.checksum_sha256, "rows": rows,
                        "byte_size": len(body)}
    return body


def wait_dead_run_lost(record, *, timeout: float = 30) -> None:
    """The dead worker's run of the export recorded lost and its slot given back: at once by its
    pool's sentinel (scheduling.deaths), or, when the sentinel died too, by the reclaim once the
    slot's lease expired (what the reclaim-leases schedule does every minute, done here)."""
    def lost() -> bool:
        reclaim_expired()
        return TaskRun.objects.filter(job=BUILD_JOB, ref=str(record.pk), outcome=Outcome.LOST).exists()
    wait_for(lost, timeout=timeout, message="the dead run to be recorded lost and its slot given back")
