"""Where export files live: Django's `STORAGES["exports"]` (local files or S3), how a publish is
made recognisable to a later attempt (the manifest), and how files are handed to a downloader
(a signed, single-use, expiring link to our own view, whatever the storage)."""
import contextlib
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import BinaryIO
from uuid import UUID

from django.conf import settings
from django.core import signing
from django.core.files import File
from django.core.files.storage import FileSystemStorage, storages
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


class _UnnamedFile(io.BufferedRandom):
    """A file with no name yet (Linux `O_TMPFILE`) in `directory`: the kernel frees it when it is
    closed or its process dies, unless it was given a name first."""

    def __init__(self, directory: str):
        # Mode 0o666 less the umask, as Django's own saves create files (before file_permissions_mode).
        super().__init__(io.FileIO(os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o666), "r+"))
        self.directory = directory


def _unnamed_file_for(storage) -> _UnnamedFile | None:
    if not isinstance(storage, FileSystemStorage) or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        return _UnnamedFile(storage.location)
    except (OSError, AttributeError):
        # No O_TMPFILE on this platform or file system, or no directory yet (a fresh install).
        return None


@contextlib.contextmanager
def staging_file() -> Iterator[BinaryIO]:
    """A temporary file to build an export in, gone once the block ends (or the process dies).

    With local storage it is an unnamed file in the storage's own directory, which `publish`
    moves into place by a rename instead of copying it (122 MB more to write per million rows:
    0.04 s of CPU on a quiet machine, 1.4 s of storage wait in a busy run of
    bench/export_throughput.py). Anywhere else (S3, no `O_TMPFILE`), an ordinary temporary file
    that `publish` copies.
    """
    tmp = _unnamed_file_for(export_storage())
    if tmp is None:
        tmp = tempfile.TemporaryFile(prefix="fairshare-export-")
    with tmp:
        yield tmp


class _NamedOnRequest(File):
    """An unnamed file offered to FileSystemStorage, which moves (renames) a file that has a
    `temporary_file_path()` instead of copying it, as it does a large upload.

    The file is given a name only when the storage asks for the path, inside its save just before
    the rename, so a save that fails or waits first (or a worker killed meanwhile) leaves nothing
    named behind. A worker killed between the two system calls leaves a `.<name>.partial` file
    beside the key, which the next publish of that key, or its deletion, removes (`_leftovers`)."""

    def __init__(self, file: _UnnamedFile, name: str, path: str):
        super().__init__(file, name=name)
        self.path = path
        self._names: list[str] = []

    def temporary_file_path(self) -> str:
        self.file.flush()
        # The storage made the key's directory before asking: name the file there, beside the key.
        directory, name = os.path.split(_partial(self.path))
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N: how open(2) says to name an O_TMPFILE.
            try:
                os.link(f"/proc/self/fd/{self.file.fileno()}", name, dst_dir_fd=fd, follow_symlinks=True)
            except FileExistsError:  # a killed attempt's
                os.remove(name, dir_fd=fd)
                os.link(f"/proc/self/fd/{self.file.fileno()}", name, dst_dir_fd=fd, follow_symlinks=True)
        finally:
            os.close(fd)
        self._names.append(os.path.join(directory, name))
        return self._names[-1]

    def remove_names(self) -> None:
        """Renamed into place already, unless the save failed after asking for the path."""
        for path in self._names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


def _partial(path: str) -> str:
    """The one name an attempt gives its file before the rename to `path`: one per key, so that
    what a killed attempt left is found without listing the directory."""
    directory, base = os.path.split(path)
    return os.path.join(directory, f".{base}.partial")


def _leftovers(storage, key: str) -> None:
    """Remove what a worker killed mid-rename left beside `key` (see `_NamedOnRequest`). A zombie
    attempt's rename that loses its file here fails its save, and its completion is fenced anyway."""
    if isinstance(storage, FileSystemStorage):
        with contextlib.suppress(FileNotFoundError):
            os.remove(_partial(storage.path(key)))


def _save(storage, key: str, fileobj) -> None:
    if isinstance(fileobj, _UnnamedFile) and isinstance(storage, FileSystemStorage):
        content = _NamedOnRequest(fileobj, name=key, path=storage.path(key))
    else:
        content = File(fileobj, name=key)
    try:
        saved_as = storage.save(key, content)
    finally:
        if isinstance(content, _NamedOnRequest):
            content.remove_names()
    if saved_as != key:
        # A storage that renames on collision would break reconciliation by key.
        raise PublishError(f"storage saved the export under {saved_as!r} instead of {key!r}")


def publish(*, key: str, fileobj, manifest: Manifest, meter: Meter) -> None:
    """Store the object, then its manifest. An object without a manifest is never trusted: a
    crash mid-write leaves at most a partial object that the next attempt overwrites.

    A `staging_file()` with local storage is renamed into place (whole or not at all)."""
    storage = export_storage()
    fileobj.seek(0)
    with meter.storage_wait():
        storage.delete(manifest_key(key))
        _save(storage, key, fileobj)
        _save(storage, manifest_key(key), io.BytesIO(json.dumps(asdict(manifest)).encode()))
        _leftovers(storage, key)


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
    _leftovers(storage, key)


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
