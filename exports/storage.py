"""Where export files live: Django's `STORAGES["exports"]` (local files or S3), and how they are
handed to a downloader (a signed, expiring URL either way)."""
from uuid import UUID

from django.conf import settings
from django.core import signing
from django.core.files import File
from django.core.files.storage import FileSystemStorage, storages
from django.urls import reverse

from budgets.metering import Meter

DOWNLOAD_SALT = "fairshare.exports.download"


class PublishError(Exception):
    pass


def export_storage():
    return storages["exports"]


def object_key(*, account_id: int, export_id: UUID) -> str:
    """Deterministic: every attempt of one export publishes to the same key."""
    return f"exports/{account_id}/{export_id}.csv"


def publish(*, key: str, fileobj, meter: Meter) -> None:
    storage = export_storage()
    fileobj.seek(0)
    with meter.storage_wait():
        saved_as = storage.save(key, File(fileobj, name=key))
    if saved_as != key:
        # A storage that renames on collision would break reconciliation by key.
        raise PublishError(f"storage saved the export under {saved_as!r} instead of {key!r}")


def delete(*, key: str) -> None:
    export_storage().delete(key)


def download_url(*, export_id: UUID, key: str, user_id: int) -> str:
    """A URL for this user that stops working after EXPORT_DOWNLOAD_TTL_S seconds."""
    ttl = settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"]
    storage = export_storage()
    if isinstance(storage, FileSystemStorage):
        token = signing.dumps({"e": str(export_id), "u": user_id}, salt=DOWNLOAD_SALT, compress=True)
        return reverse("exports:file", kwargs={"token": token})
    # S3: a presigned URL (django-storages' `expire`), served as an attachment.
    return storage.url(
        key,
        parameters={"ResponseContentDisposition": f'attachment; filename="{export_id}.csv"'},
        expire=ttl,
    )


def read_download_token(token: str) -> tuple[UUID, int]:
    """Raises signing.BadSignature (incl. SignatureExpired) for a forged or stale link."""
    data = signing.loads(token, salt=DOWNLOAD_SALT, max_age=settings.FAIRSHARE["EXPORT_DOWNLOAD_TTL_S"])
    return UUID(data["e"]), int(data["u"])
