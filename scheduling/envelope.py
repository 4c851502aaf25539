"""The queue message: small, versioned, identifiers only (SPEC §3 "Envelope").

    {"v": 1, "job": "exports.build", "account": 12, "ref": "<uuid>"}

Never put customer data or a credential in an envelope: django-q2 signs its payloads but does
not encrypt them, and they are visible in the broker and its admin.

Versions (rolling upgrades, docs/deploy.md): VERSION is the newest this code speaks; producers
send FAIRSHARE["ENVELOPE_VERSION"] (default VERSION). A worker given a newer version than it
speaks raises NeedsNewerWorker, and the runner parks the message in the holding area until a
worker that speaks it releases it (scheduling.holding.park).
"""
from dataclasses import dataclass
from typing import Any

from django.conf import settings

VERSION = 1
FIELDS = frozenset({"v", "job", "account", "ref"})
MAX_REF_LENGTH = 64


class ContractError(Exception):
    """A message this worker cannot honour. Terminal: retrying the same message cannot help."""


class NeedsNewerWorker(Exception):
    """A message of a version newer than this worker speaks: not an error, it waits for one that does."""

    def __init__(self, version: int):
        super().__init__(f"envelope version {version} needs a newer worker (this worker speaks v{known_version()})")
        self.version = version


def known_version() -> int:
    """The newest envelope version this process speaks (a test seam may raise it, scheduling/testing.py)."""
    return settings.FAIRSHARE.get("SPEAKS_ENVELOPE_VERSION") or VERSION


@dataclass(frozen=True)
class Envelope:
    job: str
    account: int | None
    ref: str
    v: int = VERSION

    def to_message(self) -> dict[str, Any]:
        return {"v": self.v, "job": self.job, "account": self.account, "ref": self.ref}


def parse(message: Any) -> Envelope:
    """Validate a raw queue message against the contract (versions 1 to known_version())."""
    if not isinstance(message, dict):
        raise ContractError(f"envelope must be an object, got {type(message).__name__}")
    # `type(...) is int`: True and 1.0 compare equal to 1 but are not version 1.
    version = message.get("v")
    if type(version) is not int or version < 1:
        raise ContractError(f"unsupported envelope version {version!r} (this worker speaks v{VERSION})")
    if version > known_version():
        raise NeedsNewerWorker(version)
    # Our own field names are written unquoted: stored errors are redacted, and redaction
    # replaces quoted literals. Unexpected keys come from the message, so they stay quoted.
    if missing := sorted(FIELDS - set(message)):
        raise ContractError(f"envelope is missing {', '.join(missing)} (v{VERSION} fields: {', '.join(sorted(FIELDS))})")
    if unexpected := sorted(map(str, set(message) - FIELDS)):
        raise ContractError(
            f"envelope has {len(unexpected)} unexpected field(s) {unexpected} "
            f"(v{VERSION} fields: {', '.join(sorted(FIELDS))})"
        )
    job, account, ref = message["job"], message["account"], message["ref"]
    if not isinstance(job, str) or not job:
        raise ContractError("envelope field job must be a non-empty string")
    if account is not None and (not isinstance(account, int) or isinstance(account, bool)):
        raise ContractError("envelope field account must be an integer id or null")
    if not isinstance(ref, str) or len(ref) > MAX_REF_LENGTH:
        raise ContractError(f"envelope field ref must be a string of at most {MAX_REF_LENGTH} characters")
    return Envelope(job=job, account=account, ref=ref, v=version)
