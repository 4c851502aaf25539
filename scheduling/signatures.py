"""Queue messages signed with another key than this worker's SECRET_KEY (a key rotation).

django-q2 signs every message with SECRET_KEY, and its pusher checks that key only: a message
signed with another (a producer whose key was rotated before or after this worker's, a command run
with another key) fails with BadSignature, is logged and deleted, and its work waits for the
reconciler to send it again minutes later — a silent drop. The brokers configured in settings
(`VerifiedFifoORM`, `VerifiedRedis`) check each message before django-q2's pusher reads it:

- signed with SECRET_KEY: passed on as it is;
- signed with one of SECRET_KEY_FALLBACKS (Django's rotation setting): passed on re-signed with
  SECRET_KEY, and runs;
- signed with no key this worker has: *unverified*. Recorded as a rejected TaskRun with its reason
  (the admin's task runs; /metrics: fairshare_task_failures{outcome="rejected"}), taken out of the
  broker, and, when it is a Fairshare message, its work is sent again at once, signed with
  SECRET_KEY.

Why sending unverified work again is safe: the signature is there because django-q2 unpickles a
message and calls the function it names. An unverified message is read without either: its pickle
is loaded with every class and function it names replaced by an inert stand-in (`_InertUnpickler`),
and only the envelope (identifiers, scheduling.envelope) is sent on, in a new message to the one
runner, which checks it as it checks every message (ContractMiddleware). What the envelope names is
in our tables (the export's record and lease, a call's arguments, the job's slot, taken when it was
first sent) and every handler is idempotent: sending it again is a duplicate delivery, which the
ORM broker makes anyway. A forged message can do no more than ring the doorbell of work that exists.
"""
import contextlib
import datetime as dt
import functools
import io
import json
import logging
import pickle
import zlib
from typing import Any

from django.conf import settings
from django.core import signing
from django.db import transaction
from django.utils.encoding import force_str
from django_q import core_signing
from django_q.brokers.redis_broker import Redis
from django_q.conf import Conf
from django_q.signing import PickleSerializer, SignedPackage

from scheduling.broker import RUNNER, FifoORM, send_message
from scheduling.connections import close_old_connections
from scheduling.services import task_run_reject

logger = logging.getLogger("fairshare.tasks")
# The most an unverified message is inflated to when it is read: a Fairshare message is a few
# hundred bytes, and a forged one must not make the pusher inflate a zip bomb.
MAX_UNVERIFIED_BYTES = 64 * 1024


class UnverifiedMessage(Exception):
    """A queue message that neither SECRET_KEY nor any of SECRET_KEY_FALLBACKS signed (recorded)."""


class VerifiedDelivery:
    """A django-q2 broker that hands its pusher only messages signed with SECRET_KEY: those signed
    with a fallback key re-signed, unverified ones recorded and their work sent again (module
    docstring). Mixed in before the broker class."""

    def dequeue(self):
        messages = super().dequeue()
        if not messages:
            return messages
        delivered = []
        for ack_id, payload in messages:
            key = signing_key(payload)
            if key == Conf.SECRET_KEY:
                delivered.append((ack_id, payload))
            elif key is not None:
                with contextlib.suppress(Exception):  # unreadable though ours: django-q2 reports it as ever
                    payload = resigned(payload, key=key)
                delivered.append((ack_id, payload))
            else:
                self.unverified(ack_id, payload)
        return delivered

    def unverified(self, ack_id, payload) -> None:
        """Record it, send its work again, and take it out of the broker: with the ORM broker all
        three in one transaction (the new message and the old one's deletion commit together). If
        that fails (the database is away), the message is left as it is: the ORM broker delivers it
        again after `retry`, and on Redis, which already gave it up, the reconciler finds its work."""
        message, signed_at = read_unverified(payload)
        try:
            close_old_connections()
            with transaction.atomic():
                sent = resendable(message)
                run = task_run_reject(message=sent, error=UnverifiedMessage(reason(signed_at, sent=sent is not None)))
                if sent is not None:
                    send_message(sent, queue=Conf.CLUSTER_NAME, name=f"{sent.get('job')}:{sent.get('ref')}",
                                 account=sent.get("account") if type(sent.get("account")) is int else None)
                self.fail(ack_id)
        except Exception as exc:
            logger.warning("recording an unverified queue message failed: left in the broker",
                           extra={"error_class": type(exc).__name__})
            return
        logger.warning("queue message signed with a key this worker does not have",
                       extra={"task_run": run.pk, "sent_again": sent is not None})


class VerifiedFifoORM(VerifiedDelivery, FifoORM):
    """The ORM broker Fairshare uses (first in, first out), checking signatures as above."""


class VerifiedRedis(VerifiedDelivery, Redis):
    """django-q2's Redis broker, checking signatures as above."""


def signing_key(payload) -> str | None:
    """The key among SECRET_KEY and SECRET_KEY_FALLBACKS that signed the message, None if none did.
    SECRET_KEY is tried first: one HMAC per message in the steady state."""
    payload = force_str(payload)  # Redis gives bytes, which Django's Signer does not take
    for key in (Conf.SECRET_KEY, *settings.SECRET_KEY_FALLBACKS):
        try:
            _signer(key, Conf.PREFIX).unsign(payload)
        except (signing.BadSignature, TypeError):
            continue
        return key
    return None


@functools.lru_cache(maxsize=16)
def _signer(key: str, salt: str) -> signing.TimestampSigner:
    """One signer per key, made once: making one costs about as much as checking a message."""
    return signing.TimestampSigner(key=key, salt=salt, fallback_keys=())


def resigned(payload, *, key: str) -> str:
    """The message signed with `key` (verified), signed with SECRET_KEY instead."""
    return SignedPackage.dumps(core_signing.loads(payload, key=key, salt=Conf.PREFIX, serializer=PickleSerializer))


def read_unverified(payload) -> tuple[dict | None, dt.datetime | None]:
    """The task a message carries and when it says it was signed, read without trusting it (no
    class or function it names is loaded); (None, None) for what cannot be read as one."""
    try:
        value, timestamp, _ = force_str(payload).rsplit(":", 2)
    except (ValueError, UnicodeDecodeError):
        return None, None
    try:
        signed_at = dt.datetime.fromtimestamp(signing.b62_decode(timestamp), tz=dt.UTC)
    except (ValueError, OverflowError, OSError):  # not a time: the reason says none
        signed_at = None
    try:
        compressed = value.startswith(".")
        data = signing.b64_decode((value[1:] if compressed else value).encode())
        if compressed:
            inflate = zlib.decompressobj()
            data = inflate.decompress(data, MAX_UNVERIFIED_BYTES)
            if inflate.unconsumed_tail:
                return None, signed_at
        task = _InertUnpickler(io.BytesIO(data)).load()
    except Exception:  # not base64, not zlib, not a pickle: unreadable
        return None, signed_at
    return (task if isinstance(task, dict) else None), signed_at


def resendable(task: dict | None) -> dict | None:
    """The envelope of a Fairshare message (the runner's one argument, JSON), or None: a message
    for any other function is not ours to vouch for."""
    if task is None or task.get("func") != RUNNER:
        return None
    args = task.get("args")
    if not isinstance(args, tuple | list) or len(args) != 1 or not isinstance(args[0], dict):
        return None
    try:
        return json.loads(json.dumps(args[0], allow_nan=False))  # plain JSON only (no inert stand-ins)
    except (TypeError, ValueError):
        return None


def reason(signed_at: dt.datetime | None, *, sent: bool) -> str:
    # No quotes: stored errors are redacted, and redaction blanks quoted text.
    fallbacks = len(settings.SECRET_KEY_FALLBACKS)
    when = f", signed at {signed_at:%Y-%m-%d %H:%M:%S} UTC" if signed_at else ""
    what = ("its work was sent again at once, signed with SECRET_KEY" if sent
            else "not a Fairshare message (or unreadable): taken out of the queue, not sent again")
    return (f"message signed with a key this worker does not have (neither SECRET_KEY nor any of its {fallbacks} "
            f"SECRET_KEY_FALLBACKS verifies it{when}): {what}")


class _Inert:
    """Stands in for every class and function an unverified pickle names: made from any arguments,
    it does nothing."""

    def __new__(cls, *args: Any, **kwargs: Any):
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _InertUnpickler(pickle.Unpickler):
    """Loads the plain data of a pickle (dicts, lists, strings, numbers) and nothing else: every
    global it names (the only way a pickle runs code) is `_Inert`."""

    def find_class(self, module: str, name: str) -> type:
        return _Inert
