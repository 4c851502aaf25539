"""The doorbell: every job reaches django-q2 as one message to one runner, on its job's queue.

`send` rings it for a job (the envelope, nothing else: SPEC §4 "the broker is a doorbell");
`send_message` puts a message in a queue as it is (a parked message of a newer version goes back
unchanged). Nothing here asks whether the job may go: that is `scheduling.runtime.enqueue`'s
gates' question.

`FifoORM` is django-q2's ORM broker, delivering in the order messages were sent. The stock ORM
broker takes "the first" due row with no ORDER BY. On PostgreSQL that is the first row in the
table's physical order, and a message inserted after others were acknowledged (and their space
reclaimed by vacuum) goes to the front of the table: a held job that one account's settlement
releases overtakes the messages other accounts sent long before, and a busy account can keep them
waiting indefinitely (SPEC §4: a flood from one account must not delay another account's jobs).
Dequeuing by id keeps the doorbells in the order they were rung.
"""
from typing import Any

from django.conf import settings
from django.db import transaction
from django_q.brokers.orm import ORM
from django_q.tasks import async_task

from scheduling.envelope import Envelope
from scheduling.registry import get_job

RUNNER = "scheduling.runtime.execute"
# django-q2's group of an account's task: its task rows are scoped by it in the admin.
ACCOUNT_GROUP = "account-{}"


class FifoORM(ORM):
    @staticmethod
    def get_connection(list_key: str | None = None):
        # Every read of the broker is in send order; update() and delete() ignore the ordering.
        return ORM.get_connection(list_key).order_by("id")


def send(*, job: str, account: int | None, ref: str, priority: int = 0) -> str:
    """Ring the doorbell: put the envelope in the job's queue, no questions asked. It goes as the
    version FAIRSHARE["ENVELOPE_VERSION"] names (pinned during a rolling upgrade, docs/deploy.md)."""
    spec = get_job(job)
    envelope = Envelope(job=spec.name, account=account, ref=str(ref), v=settings.FAIRSHARE["ENVELOPE_VERSION"],
                        priority=priority)
    return send_message(envelope.to_message(), queue=spec.queue, name=f"{spec.name}:{ref}", account=account)


def send_message(message: Any, *, queue: str, name: str, account: int | None) -> str:
    """Put a message in a queue as it is."""
    group = {"group": ACCOUNT_GROUP.format(account)} if account is not None else {}
    return async_task(RUNNER, message, cluster=queue, task_name=name[:100], **group)


def send_on_commit(*, job: str, account: int | None, ref: str, priority: int = 0) -> None:
    transaction.on_commit(lambda: send(job=job, account=account, ref=ref, priority=priority))
