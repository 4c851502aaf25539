"""django-q2's broker on RabbitMQ (settings: RABBITMQ_URL), for queues that outlive a broker restart.

What it promises, against the ORM broker (at least once) and Redis (at most once, in memory):
- a message is published persistent, to a durable (quorum) queue, and `enqueue` returns only once
  the server confirmed it: a RabbitMQ restart loses nothing that was sent;
- the pusher consumes with manual acknowledgement and a prefetch of the pool's workers: the server
  hands a pool no more than it can run, and a message is acknowledged only when its task is over
  (its run's record was committed by the runner before the result reached the monitor);
- a message that is not acknowledged goes again: at once when the pusher's connection dies (the
  whole pool killed, its host gone: the server requeues it), and after the cluster's `retry`
  seconds when the connection lives but the task never ended (its worker SIGKILLed), as the ORM
  broker does; the handlers are idempotent (SPEC §4), so a second delivery changes nothing;
- a message that does not decode, or whose envelope names an unknown job or breaks the contract,
  is dead-lettered with its reason (scheduling.dead_letters), never dropped nor run.

Who acknowledges: django-q2's pusher process fetches (`dequeue`) and its monitor process, another
process, acknowledges (`acknowledge`). An AMQP delivery can only be acknowledged on the channel
that delivered it, so the monitor's acknowledgement is relayed to the pusher through a pipe the
sentinel creates before it forks them (`ping`, which Sentinel.start calls first); a thread in the
pusher hands it to the connection's own thread (`add_callback_threadsafe`, pika's one thread-safe
call). An acknowledgement names the channel it is for (`token:delivery tag`): one for a channel
that has since died is dropped, its message has already gone back to the queue.

On a graceful stop the pusher stops consuming and waits (up to the cluster's `timeout`) for what it
handed out to be acknowledged before it closes its connection, so a stop causes no redelivery.
"""
import functools
import logging
import os
import threading
import time
import uuid
from multiprocessing import util as mp_util

from django.db import DatabaseError, close_old_connections
from django_q.brokers import Broker
from django_q.conf import Conf
from django_q.signing import SignedPackage
from pika.exceptions import AMQPError

from scheduling import amqp
from scheduling import envelope as contract
from scheduling.broker import RUNNER
from scheduling.dead_letters import dead_letter_record
from scheduling.registry import get_job

logger = logging.getLogger("fairshare.rabbitmq")


def delivery_problem(body: bytes) -> str | None:
    """Why a delivered message cannot go to a worker, or None. A newer envelope version than this
    worker speaks is no problem here: the runner parks it (rolling upgrades)."""
    try:
        task = SignedPackage.loads(body.decode())
    except Exception:
        return "the message does not decode as a task signed with this deployment's SECRET_KEY"
    if not isinstance(task, dict) or task.get("func") != RUNNER:
        return None
    args = task.get("args") or ()
    try:
        if len(args) != 1:
            raise contract.ContractError(f"the runner takes one envelope, got {len(args)} arguments")
        get_job(contract.parse(args[0]).job)
    except contract.NeedsNewerWorker:
        return None
    except contract.ContractError as exc:  # also registry.UnknownJob
        return str(exc)
    return None


class _Consumer:
    """The pusher's connection: consuming with manual acknowledgement."""

    def __init__(self, queue: str, prefetch: int):
        self.queue = queue
        self.token = uuid.uuid4().hex[:12]
        self.outstanding: dict[int, float] = {}  # delivery tag -> when it was handed out (monotonic)
        self.delivered: list[tuple[str, str]] = []
        self.connection = amqp.connect()
        try:
            self.channel = self.connection.channel()
            amqp.declare(self.channel, self.connection, queue)
            self.channel.basic_qos(prefetch_count=prefetch)
            self.consumer_tag = self.channel.basic_consume(queue, self._on_message)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the connection: the server requeues whatever it delivered and was not acknowledged."""
        try:
            if self.connection.is_open:
                self.connection.close()
        except (AMQPError, OSError):
            pass

    def _on_message(self, channel, method, properties, body: bytes) -> None:
        problem = delivery_problem(body)
        if problem is not None:
            close_old_connections()
            dead_letter_record(queue=self.queue, reason=problem, body=body, message_id=properties.message_id)
            channel.basic_nack(method.delivery_tag, requeue=False)  # to the dead-letter queue
            logger.error("message dead-lettered", extra={"queue": self.queue})
            return
        self.outstanding[method.delivery_tag] = time.monotonic()
        self.delivered.append((f"{self.token}:{method.delivery_tag}", body.decode()))

    def ack(self, ack_id: str) -> None:
        token, _, tag = ack_id.partition(":")
        if token == self.token and self.outstanding.pop(int(tag), None) is not None:
            self.channel.basic_ack(int(tag))

    def reject(self, ack_id: str, reason: str) -> None:
        token, _, tag = ack_id.partition(":")
        if token == self.token and self.outstanding.pop(int(tag), None) is not None:
            close_old_connections()
            dead_letter_record(queue=self.queue, reason=reason, body=b"", message_id=f"delivery {ack_id}")
            self.channel.basic_nack(int(tag), requeue=False)

    def requeue_stale(self, older_than_s: float) -> None:
        """Give back what was handed out `older_than_s` ago and never acknowledged: its worker died
        (or its task outlived `retry`, which the system checks keep above `timeout`)."""
        now = time.monotonic()
        for tag, since in list(self.outstanding.items()):
            if now - since > older_than_s:
                del self.outstanding[tag]
                self.channel.basic_nack(tag, requeue=True)
                logger.warning("unacknowledged message requeued", extra={"queue": self.queue})

    def drain(self, wait_s: float) -> None:
        """Stop consuming; wait for what was handed out to be acknowledged; close."""
        try:
            self.channel.basic_cancel(self.consumer_tag)
            for ack_id, _body in self.delivered:  # fetched, never handed to the pool
                self.channel.basic_nack(int(ack_id.partition(":")[2]), requeue=True)
            deadline = time.monotonic() + wait_s
            while self.outstanding and time.monotonic() < deadline:
                self.connection.process_data_events(time_limit=0.2)
        except (AMQPError, OSError):
            pass
        self.close()  # the server requeues whatever is left


class RabbitMQ(Broker):
    def __init__(self, list_key: str | None = None):
        self._relay: tuple[int, int] | None = None
        self._consumer: _Consumer | None = None
        self._consumer_pid = 0
        self._failures = 0
        super().__init__(list_key=list_key or Conf.CLUSTER_NAME)
        self.queue = amqp.queue_name(self.list_key)

    def __getstate__(self):
        return self.list_key, self._info

    def __setstate__(self, state):
        self.__init__(state[0])
        self._info = state[1]

    @staticmethod
    def get_connection(list_key: str | None = None):
        return None  # connections are per process and thread (amqp.Publisher) or the pusher's own

    # --- producing ------------------------------------------------------------------------------
    def enqueue(self, task) -> str:
        message_id = uuid.uuid4().hex
        amqp.Publisher.get().publish(self.queue, task, message_id=message_id)
        return message_id

    def queue_size(self) -> int:
        return amqp.Publisher.get().ready(self.queue)

    def lock_size(self) -> int | None:
        consumer = self._here()
        return len(consumer.outstanding) if consumer else None

    def purge_queue(self):
        return amqp.Publisher.get().call(lambda channel, connection: channel.queue_purge(self.queue))

    def delete_queue(self):
        def delete(channel, connection):
            channel.queue_delete(self.queue)
            channel.queue_delete(self.queue + amqp.DEAD_SUFFIX)
        amqp.Publisher.get().call(delete)
        amqp.Publisher.get().declared.discard(self.queue)

    def ping(self) -> bool:
        # Sentinel.start pings before it forks the pusher and the monitor: the acknowledgement
        # relay must exist by then for both to share it.
        if self._relay is None:
            read_end, write_end = os.pipe()
            os.set_blocking(write_end, False)  # a monitor never waits on a dead pusher
            self._relay = (read_end, write_end)
        return amqp.Publisher.get().call(lambda channel, connection: connection.is_open, patience_s=5.0)

    def info(self) -> str:
        if not self._info:
            version = amqp.Publisher.get().call(
                lambda channel, connection: connection._impl.server_properties.get("version", "?"))
            self._info = f"RabbitMQ {version}"
        return self._info

    # --- consuming (the pusher) -----------------------------------------------------------------
    def _here(self) -> _Consumer | None:
        return self._consumer if self._consumer_pid == os.getpid() else None

    def _connect_consumer(self) -> _Consumer:
        fresh = self._consumer_pid != os.getpid()
        self._consumer = _Consumer(self.queue, prefetch=max(1, Conf.WORKERS))
        self._consumer_pid = os.getpid()
        if fresh:  # once per process: the relay reader and the drain at exit
            if self._relay is not None:
                threading.Thread(target=self._relay_reader, name="ack-relay", daemon=True).start()
            mp_util.Finalize(None, self._drain, exitpriority=10)
        return self._consumer

    def _relay_reader(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self._relay[0], 4096)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                consumer = self._consumer
                try:
                    consumer.connection.add_callback_threadsafe(functools.partial(consumer.ack, line.decode()))
                except Exception:  # noqa: BLE001 - its connection died: the server requeued the message
                    pass

    def _drain(self) -> None:
        if (consumer := self._here()) is not None:
            consumer.drain(wait_s=Conf.TIMEOUT or 30)

    def dequeue(self):
        try:
            consumer = self._here() or self._connect_consumer()
            if Conf.RETRY:  # always set in Fairshare's settings (retry > timeout, scheduling.E001)
                consumer.requeue_stale(Conf.RETRY)
            deadline = time.monotonic() + 1.0  # as Redis' BLPOP: the pusher looks at its stop event each second
            while not consumer.delivered and (left := deadline - time.monotonic()) > 0:
                consumer.connection.process_data_events(time_limit=left)
            batch, consumer.delivered = consumer.delivered, []
            self._failures = 0
            return batch or None
        except (AMQPError, OSError, DatabaseError) as exc:
            # The server went away (or the database, recording a dead letter): what was handed out
            # and not acknowledged goes back to the queue with the connection. Reconnect, backing off.
            if (consumer := self._here()) is not None:
                consumer.close()
            self._consumer = None
            pause = amqp.backoff(self._failures)
            self._failures += 1
            logger.warning("RabbitMQ consumer lost its connection; reconnecting",
                           extra={"queue": self.queue, "error_class": type(exc).__name__, "retry_in_s": pause})
            time.sleep(pause)
            return None

    def acknowledge(self, task_id: str) -> None:
        consumer = self._here()
        if consumer is not None:  # the pusher itself (a synchronous run)
            consumer.ack(task_id)
        elif self._relay is not None:
            try:
                os.write(self._relay[1], task_id.encode() + b"\n")
            except (BlockingIOError, BrokenPipeError):
                pass  # no pusher reads: its connection is gone and the server requeued the message

    def fail(self, task_id: str) -> None:
        """django-q2's pusher could not unpack the message (delivery_problem lets none through)."""
        if (consumer := self._here()) is not None:
            consumer.reject(task_id, "the message does not decode as a task")
