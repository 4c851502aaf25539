"""The queue message: small, versioned, identifiers only (SPEC §3 "Envelope").

    {"v": 1, "job": "exports.build", "account": 12, "ref": "<uuid>"}

Never put customer data or a credential in an envelope: django-q2 signs its payloads but does
not encrypt them, and they are visible in the broker and its admin.
"""
from dataclasses import dataclass
from typing import Any

VERSION = 1
FIELDS = frozenset({"v", "job", "account", "ref"})
MAX_REF_LENGTH = 64


class ContractError(Exception):
    """A message this worker cannot honour. Terminal: retrying the same message cannot help."""


@dataclass(frozen=True)
class Envelope:
    job: str
    account: int | None
    ref: str
    v: int = VERSION

    def to_message(self) -> dict[str, Any]:
        return {"v": self.v, "job": self.job, "account": self.account, "ref": self.ref}


def parse(message: Any) -> Envelope:
    """Validate a raw queue message against contract version 1."""
    if not isinstance(message, dict):
        raise ContractError(f"envelope must be an object, got {type(message).__name__}")
    # `type(...) is int`: True and 1.0 compare equal to 1 but are not version 1.
    if type(message.get("v")) is not int or message["v"] != VERSION:
        raise ContractError(f"unsupported envelope version {message.get('v')!r} (this worker speaks v{VERSION})")
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
    return Envelope(job=job, account=account, ref=ref)
