"""Publishing an export: local storage takes the built file by a rename, any other storage through
`storage.save`; either way the object, then its manifest, and nothing else left behind."""
import hashlib
import os
import signal
import subprocess
import sys
import uuid

import pytest
from django.core.files.storage import FileSystemStorage

from scheduling.metering import Meter
from exports import storage
from tests.exports.support import stored_files
from tests.storages import FAILURES_ENV

BODY = b'"occurred_at","actor_email"\n"2026-03-01T00:00:00Z","a@example.com"\n' * 1000


def _publish(tmp, export_id: uuid.UUID, body: bytes = BODY) -> str:
    """What the build does once the export is written: publish the staging file."""
    tmp.write(body)
    tmp.flush()
    key = storage.object_key(account_id=7, export_id=export_id)
    manifest = storage.Manifest(export_id=str(export_id), sha256=hashlib.sha256(body).hexdigest(), rows=1000,
                                byte_size=len(body))
    storage.publish(key=key, fileobj=tmp, manifest=manifest, meter=Meter())
    return key


def test_local_publish_moves_the_built_file_into_place(export_root):
    export_id = uuid.uuid4()
    with storage.staging_file() as tmp:
        key = _publish(tmp, export_id)
        built = os.fstat(tmp.fileno())
    assert stored_files(export_root) == [key, key + ".manifest.json"]  # no temporary file left over
    published = (export_root / key).stat()
    assert (published.st_dev, published.st_ino) == (built.st_dev, built.st_ino)  # renamed, not copied
    assert published.st_mode & 0o777 == 0o600  # the storage's file_permissions_mode, as for any save
    assert (export_root / key).read_bytes() == BODY
    assert storage.find_published(key=key, export_id=export_id, meter=Meter()).byte_size == len(BODY)


def test_local_publish_replaces_an_earlier_object(export_root):
    export_id = uuid.uuid4()
    with storage.staging_file() as tmp:
        key = _publish(tmp, export_id, b"an earlier attempt's object")
    with storage.staging_file() as tmp:
        _publish(tmp, export_id)
    assert stored_files(export_root) == [key, key + ".manifest.json"]
    assert (export_root / key).read_bytes() == BODY
    assert storage.find_published(key=key, export_id=export_id, meter=Meter()) is not None


# A worker SIGKILLed in the one window the rename leaves: the staging file is named, not yet moved.
KILLED_MID_RENAME = """
import os, signal, sys, uuid
import django
django.setup()
from tests.exports import test_storage
from exports import storage

def rename(old, new):
    if old.endswith(".partial"):
        os.kill(os.getpid(), signal.SIGKILL)
    return RENAME(old, new)

RENAME, os.rename = os.rename, rename
with storage.staging_file() as tmp:
    test_storage._publish(tmp, uuid.UUID(sys.argv[1]))
"""


def _killed_mid_rename(export_id: uuid.UUID, export_root) -> None:
    env = {**os.environ, "FAIRSHARE_EXPORTS_ROOT": str(export_root)}
    done = subprocess.run([sys.executable, "-c", KILLED_MID_RENAME, str(export_id)], env=env, timeout=60)
    assert done.returncode == -signal.SIGKILL


def test_what_a_worker_killed_mid_rename_leaves_goes_with_the_next_publish_or_the_delete(export_root):
    export_id = uuid.uuid4()
    key = storage.object_key(account_id=7, export_id=export_id)
    _killed_mid_rename(export_id, export_root)
    [leftover] = stored_files(export_root)
    assert leftover.startswith(os.path.dirname(key) + "/." + os.path.basename(key) + ".")  # beside its key
    assert leftover.endswith(".partial")
    _killed_mid_rename(uuid.uuid4(), export_root)  # another export's, not this one's to remove

    with storage.staging_file() as tmp:
        _publish(tmp, export_id)  # the retry
    assert len(stored_files(export_root)) == 3
    assert set(stored_files(export_root)) >= {key, key + ".manifest.json"}

    [other] = set(stored_files(export_root)) - {key, key + ".manifest.json"}
    _killed_mid_rename(export_id, export_root)  # and a zombie's, after the export succeeded
    storage.delete(key=key)  # the purge
    assert stored_files(export_root) == [other]


def test_a_build_abandoned_or_failing_to_publish_leaves_nothing_in_storage(export_root, settings, tmp_path, monkeypatch):
    with storage.staging_file() as tmp:
        tmp.write(BODY)  # the build failed or was cancelled before publishing
    assert stored_files(export_root) == []

    failures = tmp_path / "failures"
    failures.write_text("1")  # the next save fails, as an unreachable store does
    monkeypatch.setenv(FAILURES_ENV, str(failures))
    settings.STORAGES = {**settings.STORAGES, "exports": {**settings.STORAGES["exports"],
                                                          "BACKEND": "tests.storages.FlakyStorage"}}
    with storage.staging_file() as tmp, pytest.raises(ConnectionResetError):
        _publish(tmp, uuid.uuid4())
    assert stored_files(export_root) == []

    export_id = uuid.uuid4()
    with storage.staging_file() as tmp:
        key = _publish(tmp, export_id)  # the retry's publish goes through
    assert stored_files(export_root) == [key, key + ".manifest.json"]
    assert (export_root / key).read_bytes() == BODY


def test_other_storages_receive_the_file_through_save(settings):
    """InMemoryStorage stands in for S3: not a local directory, so its save copies the file."""
    settings.STORAGES = {**settings.STORAGES, "exports": {"BACKEND": "django.core.files.storage.InMemoryStorage"}}
    assert not isinstance(storage.export_storage(), FileSystemStorage)
    export_id = uuid.uuid4()
    with storage.staging_file() as tmp:
        key = _publish(tmp, export_id)
    with storage.export_storage().open(key, "rb") as f:
        assert f.read() == BODY
    found = storage.find_published(key=key, export_id=export_id, meter=Meter())
    assert found is not None and found.sha256 == hashlib.sha256(BODY).hexdigest()


def test_the_first_publish_creates_the_storage_directory(export_root, settings):
    """A fresh install: the storage's directory does not exist until the first export is saved."""
    fresh = export_root / "not-yet-created"
    settings.STORAGES = {**settings.STORAGES, "exports": {**settings.STORAGES["exports"], "OPTIONS": {
        **settings.STORAGES["exports"]["OPTIONS"], "location": str(fresh)}}}
    export_id = uuid.uuid4()
    with storage.staging_file() as tmp:
        key = _publish(tmp, export_id)
    assert stored_files(fresh) == [key, key + ".manifest.json"]
    assert (fresh / key).read_bytes() == BODY
