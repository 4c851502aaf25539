"""The queue message: small, versioned, identifiers only (SPEC §3 "Envelope").

    {"v": 2, "job": "exports.build", "account": 12, "ref": "<uuid>", "priority": 0}

v2 adds `priority` (−100…100, higher first: the order of an account's held work), so that work
held again after it started (its account at its cap, a retry's back-off) keeps its place among
the account's priorities. v1 (the same without `priority`) is read as priority 0.

Never put customer data or a credential in an envelope: django-q2 signs its payloads but does
not encrypt them, and they are visible in the broker and its admin.

Versions (rolling upgrades, docs/deploy.md): VERSION is the newest this code speaks; producers
send FAIRSHARE["ENVELOPE_VERSION"] (default VERSION). A worker given a newer version than it
speaks raises NeedsNewerWorker, and the runner parks the message in the holding area until a
worker that speaks it releases it (scheduling.holding.park).
"""
from dataclasses import dataclass
from typing import Any

VERSION = 2
# The fields of each version this code speaks.
FIELDS = {1: frozenset({"v", "job", "account", "ref"}), 2: frozenset({"v", "job", "account", "ref", "priority"})}
MAX_REF_LENGTH = 64
PRIORITIES = range(-100, 101)  # as Django's Tasks API: -100 (last) ... 100 (first)


class ContractError(Exception):
    """A message this worker cannot honour. Terminal: retrying the same message cannot help."""


class NeedsNewerWorker(Exception):
    """A message of a version newer than this worker speaks: not an error, it waits for one that does."""

    def __init__(self, version: int):
        super().__init__(f"envelope version {version} needs a newer worker (this worker speaks v{known_version()})")
        self.version = version


def known_version() -> int:
    """The newest envelope version this process speaks (a test seam may raise it, scheduling/testing.py)."""
    from django.conf import settings  # here: scheduling/conf.py reads VERSION before Django is set up

    return settings.FAIRSHARE.get("SPEAKS_ENVELOPE_VERSION") or VERSION


def check_priority(priority: int) -> int:
    """A priority as enqueue takes it: an int in PRIORITIES (else ValueError)."""
    if type(priority) is not int or priority not in PRIORITIES:
        raise ValueError(f"priority must be an integer from {PRIORITIES.start} to {PRIORITIES.stop - 1}, "
                         f"got {priority!r}")
    return priority


@dataclass(frozen=True)
class Envelope:
    job: str
    account: int | None
    ref: str
    v: int = VERSION
    priority: int = 0

    def to_message(self) -> dict[str, Any]:
        """The message of version `v` (a v1 message cannot carry the priority: pinned to v1
        during a rolling upgrade, work that is held again after it started is held at 0)."""
        message = {"v": self.v, "job": self.job, "account": self.account, "ref": self.ref}
        if self.v >= 2:
            message["priority"] = self.priority
        return message


def parse(message: Any) -> Envelope:
    """Validate a raw queue message against the contract (versions 1 to known_version()): the
    fields of its version (FIELDS; a version newer than VERSION that a test seam lets this process
    speak is read as VERSION)."""
    if not isinstance(message, dict):
        raise ContractError(f"envelope must be an object, got {type(message).__name__}")
    # `type(...) is int`: True and 1.0 compare equal to 1 but are not version 1.
    version = message.get("v")
    if type(version) is not int or version < 1:
        raise ContractError(f"unsupported envelope version {version!r} (this worker speaks v1 to v{known_version()})")
    if version > known_version():
        raise NeedsNewerWorker(version)
    # Our own field names are written unquoted: stored errors are redacted, and redaction
    # replaces quoted literals. Unexpected keys come from the message, so they stay quoted.
    fields = FIELDS[min(version, VERSION)]
    listed = f"v{version} fields: {', '.join(sorted(fields))}"
    if missing := sorted(fields - set(message)):
        raise ContractError(f"envelope is missing {', '.join(missing)} ({listed})")
    if unexpected := sorted(map(str, set(message) - fields)):
        raise ContractError(f"envelope has {len(unexpected)} unexpected field(s) {unexpected} ({listed})")
    job, account, ref = message["job"], message["account"], message["ref"]
    if not isinstance(job, str) or not job:
        raise ContractError("envelope field job must be a non-empty string")
    if account is not None and (not isinstance(account, int) or isinstance(account, bool)):
        raise ContractError("envelope field account must be an integer id or null")
    if not isinstance(ref, str) or len(ref) > MAX_REF_LENGTH:
        raise ContractError(f"envelope field ref must be a string of at most {MAX_REF_LENGTH} characters")
    priority = message.get("priority", 0)
    if type(priority) is not int or priority not in PRIORITIES:
        raise ContractError(f"envelope field priority must be an integer from {PRIORITIES.start} to "
                            f"{PRIORITIES.stop - 1}")
    return Envelope(job=job, account=account, ref=ref, v=version, priority=priority)
