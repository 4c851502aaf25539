"""Storage backends for the test suite, chosen in a worker by FAIRSHARE_EXPORTS_STORAGE_BACKEND."""
import errno
import fcntl
import os
import time

from django.core.files.storage import FileSystemStorage

from scheduling import testing

# A file holding how many more saves should fail; shared by every worker process of a test.
FAILURES_ENV = testing.FLAKY_STORAGE_FAILURES.env
# Stands in for a credential a storage client might quote in its error text.
LEAKY_SECRET = "s3cr3t-storage-password"


class FlakyStorage(FileSystemStorage):
    """Local storage whose saves fail with a connection error while its failure counter is
    positive, the way an unreachable object store fails. Each failure decrements the counter.

    The error text quotes the file's path and an endpoint with credentials, as storage clients
    do: what Fairshare stores about the failure must not."""

    def _save(self, name, content):
        if self._take_failure():
            raise ConnectionResetError(
                errno.ECONNRESET,
                f"Connection reset by peer (endpoint https://exports:{LEAKY_SECRET}@storage.internal:9000)",
                self.path(name),
            )
        return super()._save(name, content)

    @staticmethod
    def _take_failure() -> bool:
        path = os.environ.get(FAILURES_ENV)
        if not path:
            return False
        with open(path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            left = int(f.read().strip() or 0)
            if left <= 0:
                return False
            f.seek(0)
            f.truncate()
            f.write(str(left - 1))
            return True


# A file whose existence lets saves through; until then every save waits (at most GATE_MAX_S).
GATE_ENV = testing.TEST_PUBLISH_GATE.env
GATE_MAX_S = 60


class GatedStorage(FileSystemStorage):
    """Local storage whose saves wait for a gate file: holds an export in its publish step for as
    long as a test needs, whatever the speed of the machine."""

    def _save(self, name, content):
        gate = os.environ.get(GATE_ENV, "")
        deadline = time.monotonic() + GATE_MAX_S
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        return super()._save(name, content)


class LeakyS3Storage(FileSystemStorage):
    """Local storage that refuses every save the way an S3 client with a bad key id does, quoting
    the key id, the endpoint's credentials and an API token in its error text."""

    def _save(self, name, content):
        raise PermissionError(
            "An error occurred (InvalidAccessKeyId) when calling the PutObject operation: The AWS Access Key Id "
            "AKIAIOSFODNN7EXAMPLE you provided does not exist in our records (endpoint "
            "https://exports:Dsn-pa55word@s3.internal; caller fs_PlantedToken1234567890abcdef)")
