"""`python manage.py door`: the consumer of the door for other services (tasks/door.py, docs/door.md).

Run it beside the qclusters (one or more, anywhere; each takes one message at a time). Each message
becomes one task call of its account, and is acknowledged only once the call and its message id
are committed: killed in between, the message comes again and finds its call (nothing new). A
message that is not the contract is dead-lettered with its reason. A lost RabbitMQ connection is
reconnected with back-off; SIGTERM or SIGINT stops it after the message in hand.
"""
import logging
import signal
import threading

from django.core.management.base import BaseCommand
from django.db import DatabaseError, close_old_connections
from pika.exceptions import AMQPError

from scheduling import amqp
from scheduling.dead_letters import dead_letter_record
from scheduling.faults import fault_point
from tasks import door

logger = logging.getLogger("fairshare.door")


class Command(BaseCommand):
    help = "Turn messages of the RabbitMQ door into task calls of their accounts (docs/door.md)."

    def handle(self, *args, **options):
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        failures = 0
        while not stop.is_set():
            try:
                self.consume(stop)
                failures = 0
            except (AMQPError, OSError) as exc:
                pause = amqp.backoff(failures)
                failures += 1
                logger.warning("door lost its RabbitMQ connection; reconnecting",
                               extra={"error_class": type(exc).__name__, "retry_in_s": pause})
                stop.wait(pause)

    def consume(self, stop: threading.Event) -> None:
        connection = amqp.connect()
        try:
            channel = connection.channel()
            queue = door.declare(channel, connection)
            channel.basic_qos(prefetch_count=1)
            logger.info("door consuming", extra={"queue": queue})
            for method, properties, body in channel.consume(queue, inactivity_timeout=1):
                if method is not None:
                    self.take(channel, queue, method, properties, body)
                if stop.is_set():
                    break
            channel.cancel()
        finally:
            if connection.is_open:
                connection.close()

    def take(self, channel, queue: str, method, properties, body: bytes) -> None:
        close_old_connections()
        try:
            call_id, created = door.accept(door.parse(body))
        except door.Refused as refused:
            dead_letter_record(queue=queue, reason=refused.reason, body=body, account_id=refused.account_id,
                               message_id=refused.message_id or properties.message_id)
            channel.basic_nack(method.delivery_tag, requeue=False)  # to the dead-letter queue
            logger.warning("door message dead-lettered", extra={"queue": queue})
            return
        except DatabaseError as exc:
            # The database is away: the message goes back to the queue, and this consumer waits a little.
            channel.basic_nack(method.delivery_tag, requeue=True)
            logger.warning("door could not record a message; it goes back", extra={"error_class": type(exc).__name__})
            threading.Event().wait(1.0)
            return
        fault_point("door_before_ack")  # recorded and committed, not yet acknowledged
        channel.basic_ack(method.delivery_tag)
        logger.info("door message accepted", extra={"task_call": call_id, "new_call": created})
