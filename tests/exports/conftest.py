"""Fixtures for export tests that run real `qcluster` workers."""
import pytest

# Worker settings that make crash recovery observable in seconds instead of minutes: short export
# and reservation leases (a dead worker's claim and budget slot expire after 2 s), small batches
# (so there is a "middle" of the stream to die in), a fast pulse, and notifications written to
# files the test can count.
FAST_RECOVERY = {
    "FAIRSHARE_EXPORT_WORKERS": "1",
    "FAIRSHARE_EXPORT_BATCH_ROWS": "50",
    "FAIRSHARE_EXPORT_LEASE": "2",
    "FAIRSHARE_RESERVATION_LEASE": "2",
    "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5",
    "FAIRSHARE_RELEASE_POLL": "0.2",
    "EMAIL_BACKEND": "django.core.mail.backends.filebased.EmailBackend",
}


@pytest.fixture
def mail_dir(tmp_path):
    path = tmp_path / "mail"
    path.mkdir()
    return path


@pytest.fixture
def start_exports(start_cluster, mail_dir):
    """Start an exports `qcluster` with FAST_RECOVERY settings (overridable per test)."""

    def start(**env: str):
        return start_cluster("exports", **{**FAST_RECOVERY, "EMAIL_FILE_PATH": str(mail_dir), **env})

    return start
