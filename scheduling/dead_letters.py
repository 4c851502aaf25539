"""Dead letters: RabbitMQ messages that nobody can honour (one that does not decode, names an unknown
job, or breaks the door's contract). Never dropped: the message goes to its queue's dead-letter
queue (scheduling.amqp) and its reason is recorded here first, for the admin and /metrics.

A message delivered again before it was rejected (its consumer died in between) is the same dead
letter: it is keyed by queue and message id (or the body's digest when it has none).
"""
import hashlib

from django.db import IntegrityError, transaction
from django.db.models import F
from django.db.models.functions import Now

from scheduling.models import DeadLetter
from scheduling.redaction import redact

BODY_SHOWN_CHARS = 1000


def dead_letter_key(*, queue: str, body: bytes, message_id: str | None) -> str:
    return f"{queue}:{message_id or 'sha256-' + hashlib.sha256(body).hexdigest()}"[:200]


def dead_letter_record(*, queue: str, reason: str, body: bytes, message_id: str | None = None,
                       account_id: int | None = None) -> DeadLetter:
    key = dead_letter_key(queue=queue, body=body, message_id=message_id)
    # An atomic count: two consumers that got the same message (a redelivery) both say so.
    if not DeadLetter.objects.filter(key=key).update(deliveries=F("deliveries") + 1, last_seen_at=Now()):
        try:
            with transaction.atomic():
                return DeadLetter.objects.create(
                    key=key, queue=queue, reason=redact(reason), message_id=(message_id or "")[:200],
                    account_id=account_id, body=redact(body[:4 * BODY_SHOWN_CHARS].decode("utf-8", "replace"),
                                                       max_length=BODY_SHOWN_CHARS),
                    body_bytes=len(body))
        except IntegrityError:  # recorded meanwhile by another consumer
            DeadLetter.objects.filter(key=key).update(deliveries=F("deliveries") + 1, last_seen_at=Now())
    return DeadLetter.objects.get(key=key)
