"""django-q2's broker on RabbitMQ (settings: RABBITMQ_URL), for queues that outlive a broker restart.

What it promises, against the ORM broker (at least once) and Redis (at most once, in memory):
- a message is published persistent, to a durable (quorum) queue, and `enqueue` returns only once
  the server confirmed it: a RabbitMQ restart loses nothing that was sent;
- the pusher consumes with manual acknowledgement and a prefetch of the pool's workers: the server
  hands a pool no more than it can run, and a message is acknowledged only when its task is over
  (its run's record was committed by the runner before the result reached the monitor);
- a message that is not acknowledged goes again: at once when the pusher's connection dies (the
  whole pool killed, its host gone: the server requeues it); when the worker running it dies, a
  copy FAIRSHARE["RABBITMQ_REDELIVER_AFTER_DEATH_S"] later, once the dead run's leases have
  expired, through the queue's waiting room, while the pool gets its place back at once (each
  worker tells the pusher which delivery it took, from django-q2's `pre_execute`, and the pusher
  watches that process; the copy is dropped when the delivery is acknowledged after all, its
  result handed in or its task handed on by the dead worker's sentinel: scheduling.deaths); and
  after the cluster's `retry` seconds when nothing is heard of it (as the ORM broker does). The
  handlers are idempotent (SPEC §4): a second delivery changes nothing. Without the worker's word,
  a SIGKILLed worker would hold one of the pool's prefetch places until `retry` (half an hour on
  the exports queue): a one-worker pool would stall;
- a message that does not decode, or whose envelope names an unknown job or breaks the contract,
  is dead-lettered with its reason (scheduling.dead_letters), never dropped nor run.

Who acknowledges: django-q2's pusher process fetches (`dequeue`) and its monitor process, another
process, acknowledges (`acknowledge`). An AMQP delivery can only be acknowledged on the channel
that delivered it, so the monitor's acknowledgement is relayed to the pusher through a pipe the
sentinel creates before it forks them (`ping`, which Sentinel.start calls first;
scheduling.rabbitmq_pusher); a thread in the pusher hands it to the connection's own thread (`add_callback_threadsafe`, pika's one thread-safe
call). An acknowledgement names the channel it is for (`token:delivery tag`): one for a channel
that has since died is dropped, its message has already gone back to the queue. The workers write
to the same pipe which delivery they took ("take <id> <pid>").

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

from django.conf import settings
from django.db import DatabaseError
from django_q.brokers import Broker
from django_q.conf import Conf
from pika.exceptions import AMQPError

from scheduling import amqp
from scheduling.rabbitmq_pusher import Consumer, open_relay, relay_read_end, tell_pusher

logger = logging.getLogger("fairshare.rabbitmq")


class RabbitMQ(Broker):
    def __init__(self, list_key: str | None = None):
        self._consumer: Consumer | None = None
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
            channel.queue_delete(self.queue + amqp.LATER_SUFFIX)
        amqp.Publisher.get().call(delete)
        amqp.Publisher.get().declared.discard(self.queue)

    def ping(self) -> bool:
        # Sentinel.start pings before it forks the pusher and the monitor: the acknowledgement
        # relay must exist by then for both to share it.
        open_relay()
        return amqp.Publisher.get().call(lambda channel, connection: connection.is_open, patience_s=5.0)

    def info(self) -> str:
        if not self._info:
            version = amqp.Publisher.get().call(
                lambda channel, connection: connection._impl.server_properties.get("version", "?"))
            self._info = f"RabbitMQ {version}"
        return self._info

    # --- consuming (the pusher) -----------------------------------------------------------------
    def _here(self) -> Consumer | None:
        return self._consumer if self._consumer_pid == os.getpid() else None

    def _connect_consumer(self) -> Consumer:
        fresh = self._consumer_pid != os.getpid()
        self._consumer = Consumer(self.queue, prefetch=max(1, Conf.WORKERS))
        self._consumer_pid = os.getpid()
        if fresh:  # once per process: the relay reader and the drain at exit
            if relay_read_end() is not None:
                threading.Thread(target=self._relay_reader, name="ack-relay", daemon=True).start()
            mp_util.Finalize(None, self._drain, exitpriority=10)
        return self._consumer

    def _relay_reader(self) -> None:
        """Lines from the monitor ("ack <id>") and the workers ("take <id> <pid>"), handed to the
        consumer's connection thread."""
        pending = b""
        while True:
            chunk = os.read(relay_read_end(), 4096)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                what, ack_id, *pid = line.decode().split()
                try:
                    consumer = self._consumer
                    call = (functools.partial(consumer.ack, ack_id) if what == "ack"
                            else functools.partial(consumer.taken, ack_id, int(pid[0])))
                    consumer.connection.add_callback_threadsafe(call)
                except Exception:  # noqa: BLE001 - its connection died: the server requeued the message
                    pass

    def _drain(self) -> None:
        if (consumer := self._here()) is not None:
            consumer.drain(wait_s=Conf.TIMEOUT or 30)

    def dequeue(self):
        try:
            consumer = self._here() or self._connect_consumer()
            consumer.requeue_orphans(settings.FAIRSHARE["RABBITMQ_REDELIVER_AFTER_DEATH_S"])
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
        else:
            tell_pusher(f"ack {task_id}")

    def fail(self, task_id: str) -> None:
        """django-q2's pusher could not unpack the message (delivery_problem lets none through)."""
        if (consumer := self._here()) is not None:
            consumer.reject(task_id, "the message does not decode as a task")
