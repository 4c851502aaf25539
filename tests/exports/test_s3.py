"""Exports on S3 (django-storages' S3 backend against the real S3 server scripts/test starts, over
HTTP): downloads streamed from the private object, reconciliation from the manifest, and retention
purge.
(The export end-to-end test and the crash matrix also run on S3: test_end_to_end.py, test_crash.py.)
"""
import datetime as dt
import hashlib
import urllib.error
import urllib.request

import pytest
from django.test import Client
from django.utils import timezone

from exports import storage
from exports.build import export_build
from exports.maintenance import purge_expired_exports
from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from scheduling.metering import Meter
from scheduling.models import Outcome
from tests.exports.support import RANGE, add_events

pytestmark = pytest.mark.django_db(transaction=True)
S3 = pytest.mark.parametrize("export_store", ["s3"], indirect=True)


def _build(account, owner, rows: int = 20) -> ExportRecord:
    add_events(account, rows)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    result = export_build(export_id=record.pk, account_id=account.pk, owner="test", meter=Meter())
    assert result.outcome == Outcome.SUCCEEDED
    record.refresh_from_db()
    return record


@S3
def test_a_download_on_s3_streams_the_private_object_through_a_single_use_link(account, owner, export_store):
    # No presigned (bearer) URL leaves the application (docs/architecture.md "Downloads"): the
    # link is Fairshare's, short-lived and single-use, and the object itself stays private.
    record = _build(account, owner)
    client = Client()
    client.force_login(owner)

    link = client.get(f"/api/exports/{record.pk}/download/")["Location"]
    served = client.get(link)

    assert link.startswith("/api/exports/file/") and served.status_code == 200
    body = b"".join(served.streaming_content)
    assert hashlib.sha256(body).hexdigest() == record.checksum_sha256
    assert client.get(link).status_code == 410  # used once
    endpoint = export_store.client.meta.endpoint_url
    with pytest.raises(urllib.error.HTTPError) as refused:  # no way round it to the object
        urllib.request.urlopen(f"{endpoint}/{export_store.bucket}/{record.output_key}", timeout=30)
    assert refused.value.code == 403


@S3
def test_a_publish_on_s3_is_found_again_from_its_manifest_and_a_tampered_one_is_not(account, owner, export_store):
    record = _build(account, owner)
    key = record.output_key

    found = storage.find_published(key=key, export_id=record.pk, meter=Meter())

    assert found is not None
    assert (found.sha256, found.rows, found.byte_size) == (record.checksum_sha256, 20, record.byte_size)
    assert export_store.files() == [key, key + ".manifest.json"]
    export_store.client.put_object(Bucket=export_store.bucket, Key=key, Body=b"truncated")
    assert storage.find_published(key=key, export_id=record.pk, meter=Meter()) is None


@S3
def test_retention_purge_deletes_the_s3_object_and_its_manifest(account, owner, export_store):
    record = _build(account, owner)
    kept = _build_another(account, owner)
    ExportRecord.objects.filter(pk=record.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))

    assert purge_expired_exports() == 1

    assert export_store.files() == [kept.output_key, kept.output_key + ".manifest.json"]
    assert not ExportRecord.objects.filter(pk=record.pk).exists()


def _build_another(account, owner) -> ExportRecord:
    record, _ = export_request(account_slug="acme", user=owner, start=dt.date(2026, 3, 1), end=dt.date(2026, 3, 30))
    export_build(export_id=record.pk, account_id=account.pk, owner="test", meter=Meter())
    record.refresh_from_db()
    assert record.status == ExportStatus.SUCCEEDED
    return record
