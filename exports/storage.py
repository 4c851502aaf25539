"""Where export files live: Django's `STORAGES["exports"]` (local files or S3), how a publish is
made recognisable to a later attempt (the manifest), and how files are handed to a downloader
(a signed, single-use, expiring link to our own view, whatever the storage)."""
import hashlib
import io
import json
from dataclasses import asdict, dataclass
from uuid import UUID

from django.conf import settings
from django.core import signing
from django.core.files import File
from django.core.files.storage import storages
from django.urls import reverse

from scheduling.metering import Meter

DOWNLOAD_SALT = "fairshare.exports.download"


class PublishError(Exception):
    pass


def export_storage():
    return storages["exports"]


def object_key(*, account_id: int, export_id: UUID) -> str:
    """Deterministic: every attempt of one export publishes to the same key."""
    return f"exports/{account_id}/{export_id}.csv"


@dataclass(frozen=True)
class Manifest:
    """Written next to the object, after it: the proof that the object is whole and whose it is."""

    export_id: str
    sha256: str
    rows: int
    byte_size: int


def manifest_key(key: str) -> str:
    return key + ".manifest.json"


def _save(storage, key: str, fileobj) -> None:
    saved_as = storage.save(key, File(fileobj, name=key))
    if saved_as != key:
        # A storage that renames on collision would break reconciliation by key.
        raise PublishError(f"storage saved the export under {saved_as!r} instead of {key!r}")


def publish(*, key: str, fileobj, manifest: Manifest, meter: Meter) -> None:
    """Store the object, then its manifest. An object without a manifest is never trusted: a
    crash mid-write leaves at most a partial object that the next attempt overwrites."""
    storage = export_storage()
    fileobj.seek(0)
    with meter.storage_wait():
        storage.delete(manifest_key(key))
        _save(storage, key, fileobj)
        _save(storage, manifest_key(key), io.BytesIO(json.dumps(asdict(manifest)).encode()))


def find_published(*, key: str, export_id: UUID, meter: Meter) -> Manifest | None:
    """The manifest of a whole object already published for this export under `key`, if any.

    Reconciliation on retry: an attempt that published and then died (or whose publish timed out
    after writing) left a result; verify it against its manifest instead of publishing again.
    """
    storage = export_storage()
    with meter.storage_wait():
        if not storage.exists(manifest_key(key)) or not storage.exists(key):
            return None
        with storage.open(manifest_key(key), "rb") as f:
            try:
                manifest = Manifest(**json.loads(f.read()))
            except (ValueError, TypeError):
                return None
        if manifest.export_id != str(export_id):
            return None
        digest, size = hashlib.sha256(), 0
        with storage.open(key, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
                size += len(chunk)
    if (digest.hexdigest(), size) != (manifest.sha256, manifest.byte_size):
        return None
    return manifest


def delete(*, key: str) -> None:
    storage = export_storage()
    storage.delete(manifest_key(key))
    storage.delete(key)


def download_url(*, export_id: UUID, user_id: int) -> str:
    """A link for this user that works once, within EXPORT_DOWNLOAD_TTL_S seconds (local files
    and S3 alike: the file streams through `exports.views.export_file`, so no bearer URL - an S3
    presigned one - ever leaves the application; see docs/architecture.md "Downloads")."""
    from exports.models import DownloadGrant

    grant = DownloadGrant.objects.create(export_id=export_id, user_id=user_id)
    token = signing.dumps({"g": str(grant.pk)}, salt=DOWNLOAD_SALT, compress=True)
    return reverse("exports:file", kwargs={"token": token})


def read_download_token(token: str) -> UUID:
    """The grant a link names. Raises signing.BadSignature (incl. SignatureExpired) for a forged or
    stale link."""
    data = signing.loads(token, salt=DOWNLOAD_SALT, max_age=settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"])
    return UUID(data["g"])
