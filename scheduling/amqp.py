"""RabbitMQ connections, queue declarations and confirmed publishing, for the RabbitMQ broker
(scheduling.rabbitmq) and the door for other services (scheduling.door).

The client is pika (requirements.txt says why): RabbitMQ's own tutorials use it, it is pure Python
with no dependency, and its BlockingConnection has the one thread-safe call the broker needs
(`add_callback_threadsafe`, to acknowledge on the consumer's channel from a relay thread). kombu
would add its transport abstraction and two more packages for the same few AMQP calls.

Words:
- a **queue** here is a durable RabbitMQ queue named FAIRSHARE["RABBITMQ_PREFIX"] + "." + the
  django-q2 cluster name ("fairshare.default"); quorum where the server supports them (3.8 and
  later), classic durable otherwise (FAIRSHARE["RABBITMQ_QUEUE_TYPE"]).
- its **dead-letter queue** is the queue's name + ".dead": a message the queue's consumer rejects
  (`basic_nack(requeue=False)`) goes there through the default exchange, and stays for an operator
  (its reason is recorded in scheduling.DeadLetter).
- its **waiting room** is the queue's name + ".later": a message put there with an expiration
  goes to the queue when it expires (the copy of a message whose worker died, sent again once the
  dead run's leases have expired: scheduling.rabbitmq_pusher).
- to **publish** is to put a persistent message (delivery mode 2) in a queue and wait for the
  server's confirm: when `publish` returns the message is on disk (or replicated), else it raised.
"""
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import pika
from django.conf import settings
from pika.exceptions import AMQPChannelError, AMQPConnectionError, AMQPError

logger = logging.getLogger("fairshare.amqp")

DEAD_SUFFIX = ".dead"
LATER_SUFFIX = ".later"
# Reconnection back-off: from the first to the last pause, doubling (seconds).
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.2, 5.0
# A publish keeps trying (reconnecting with back-off) for this long before it raises: a broker
# restart takes a few seconds, and an enqueue that raises loses nothing (the caller is told).
PUBLISH_PATIENCE_S = 30.0
HEARTBEAT_S = 30

T = TypeVar("T")


def url() -> str:
    return settings.RABBITMQ_URL


def queue_name(cluster: str) -> str:
    return f"{settings.FAIRSHARE['RABBITMQ_PREFIX']}.{cluster}"


def backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** attempt)


def connect() -> pika.BlockingConnection:
    parameters = pika.URLParameters(url())
    # Unless the URL says otherwise: a heartbeat finds a dead peer (a host gone, a cut network) in
    # about a minute, so the server requeues a vanished consumer's messages and a client reconnects.
    if "heartbeat" not in url():
        parameters.heartbeat = HEARTBEAT_S
    parameters.connection_attempts = 1
    parameters.blocked_connection_timeout = 60
    return pika.BlockingConnection(parameters)


def _quorum(connection: pika.BlockingConnection) -> bool:
    wanted = settings.FAIRSHARE["RABBITMQ_QUEUE_TYPE"]
    if wanted != "auto":
        return wanted == "quorum"
    # pika keeps the server's Connection.Start properties on the connection it wraps.
    version = str(connection._impl.server_properties.get("version", "0"))
    major_minor = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return major_minor >= (3, 8)


def declare(channel, connection: pika.BlockingConnection, name: str) -> int:
    """Declare `name` and its dead-letter queue (idempotent); returns the messages ready in it."""
    kind = {"x-queue-type": "quorum"} if _quorum(connection) else {}
    channel.queue_declare(name + DEAD_SUFFIX, durable=True, arguments=dict(kind))
    frame = channel.queue_declare(name, durable=True, arguments={
        **kind, "x-dead-letter-exchange": "", "x-dead-letter-routing-key": name + DEAD_SUFFIX})
    return frame.method.message_count


def declare_later(channel, name: str) -> str:
    """`name`'s waiting room, `name` + ".later": a message put there with an expiration goes back to
    `name` when it expires (dead-lettered through the default exchange). Classic and durable: every
    message in it waits as long, so the one at its head is always the first due."""
    later = name + LATER_SUFFIX
    channel.queue_declare(later, durable=True, arguments={
        "x-dead-letter-exchange": "", "x-dead-letter-routing-key": name})
    return later


class Publisher:
    """One connection and confirming channel per process and thread (pika's connections are not
    thread-safe, and a forked child must not write on its parent's socket)."""

    _local = threading.local()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.connection: pika.BlockingConnection | None = None
        self.channel = None
        self.declared: set[str] = set()
        self.used_at = 0.0

    @classmethod
    def get(cls) -> "Publisher":
        publisher = getattr(cls._local, "publisher", None)
        if publisher is None or publisher.pid != os.getpid():
            publisher = cls._local.publisher = cls()
        return publisher

    def _open(self):
        # An idle BlockingConnection answers no heartbeat: the server drops it after two missed ones.
        # One idle for longer than a heartbeat is replaced before use rather than found dead.
        if self.connection is not None and time.monotonic() - self.used_at > HEARTBEAT_S:
            self.close()
        self.used_at = time.monotonic()
        if self.connection is None or self.connection.is_closed or self.channel is None or self.channel.is_closed:
            self.close()
            self.connection = connect()
            self.channel = self.connection.channel()
            self.channel.confirm_delivery()
            self.declared = set()
        return self.channel

    def close(self) -> None:
        connection, self.connection, self.channel = self.connection, None, None
        if connection is not None and connection.is_open:
            try:
                connection.close()
            except AMQPError:
                pass

    def call(self, action: Callable[..., T], *, patience_s: float = PUBLISH_PATIENCE_S) -> T:
        """`action(channel, connection)`, reconnecting with back-off on a lost connection until
        `patience_s` has passed (then the last error is raised)."""
        deadline = time.monotonic() + patience_s
        attempt = 0
        while True:
            try:
                return action(self._open(), self.connection)
            except (AMQPConnectionError, AMQPChannelError, OSError) as exc:
                self.close()
                if time.monotonic() + backoff(attempt) > deadline:
                    raise
                logger.warning("RabbitMQ unavailable, retrying", extra={"error_class": type(exc).__name__})
                time.sleep(backoff(attempt))
                attempt += 1

    def publish(self, queue: str, body: bytes | str, *, message_id: str | None = None,
                headers: dict | None = None) -> None:
        """Publish a persistent message to `queue` (declared first) and wait for its confirm.
        `mandatory`: a message no queue takes raises rather than vanishing."""
        properties = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent, message_id=message_id,
                                          headers=headers, content_type="application/octet-stream")

        def send(channel, connection):
            if queue not in self.declared:
                declare(channel, connection, queue)
                self.declared.add(queue)
            channel.basic_publish("", queue, body, properties=properties, mandatory=True)

        self.call(send)

    def publish_later(self, queue: str, body: bytes | str, *, delay_s: float) -> None:
        """Publish a persistent message that reaches `queue` `delay_s` from now (its waiting room)."""
        properties = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent,
                                          expiration=str(max(0, int(delay_s * 1000))))

        def send(channel, connection):
            later = declare_later(channel, queue)
            channel.basic_publish("", later, body, properties=properties, mandatory=True)

        self.call(send)

    def ready(self, queue: str) -> int:
        """Messages waiting in `queue` to be delivered (not those delivered and not yet acknowledged)."""
        return self.call(lambda channel, connection: declare(channel, connection, queue), patience_s=2.0)
