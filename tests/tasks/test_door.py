"""The door for other services (tasks/door.py): a real `manage.py door` consumer on the RabbitMQ server,
fed by a producer in plain pika as docs/door.md shows. A message becomes one call of its account,
once per message id; each malformed kind is dead-lettered with its reason and reaches no worker;
the consumer killed between recording and acknowledging creates nothing new on redelivery."""
import json
import time

import pika
import pytest
from django.test import Client

from scheduling import amqp
from scheduling.models import DeadLetter
from scheduling.processes import Cluster
from tasks import door
from tasks.models import DoorMessage, TaskCall
from tests.conftest import wait_for, worker_env
from tests.factories import AccountFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

WHOSE = "tests.tasks.functions.whose"  # whose(account: int, label: str)
ECHO = "tests.tasks.functions.echo"


@pytest.fixture
def start_door(rabbitmq, tmp_path, export_root):
    consumers: list[Cluster] = []

    def start(**env: str) -> Cluster:
        consumer = Cluster("default", worker_env(export_root, **rabbitmq.env, FAIRSHARE_DOOR_TASKS=f"{WHOSE},{ECHO}",
                                                 FAIRSHARE_TASKS_MAX_ARGS_BYTES="200", **env),
                           tmp_path / f"door-{len(consumers)}.log", command="door")
        consumers.append(consumer)
        return consumer

    # The producer's side exists before the first message: the exchange, the queue, the binding.
    connection = amqp.connect()
    door.declare(connection.channel(), connection)
    connection.close()
    yield start
    for consumer in consumers:
        consumer.stop()
    connection = amqp.connect()
    channel = connection.channel()
    for queue in (amqp.queue_name("door"), amqp.queue_name("door") + amqp.DEAD_SUFFIX):
        channel.queue_delete(queue)
    channel.exchange_delete(door.exchange_name())
    connection.close()


def produce(body: bytes | str | dict, *, message_id: str | None = None) -> None:
    """What another service does (docs/door.md): plain pika, a persistent message to the exchange."""
    if isinstance(body, dict):
        body = json.dumps(body)
    connection = pika.BlockingConnection(pika.URLParameters(amqp.url()))
    channel = connection.channel()
    channel.confirm_delivery()
    channel.basic_publish(exchange=door.exchange_name(), routing_key="task", body=body,
                          properties=pika.BasicProperties(delivery_mode=2, content_type="application/json",
                                                          message_id=message_id))
    connection.close()


def in_queue(name: str) -> int:
    connection = amqp.connect()
    try:
        return connection.channel().queue_declare(name, passive=True).method.message_count
    finally:
        connection.close()


def test_a_message_becomes_one_call_of_its_account_and_a_redelivery_creates_nothing(start_door, account):
    consumer = start_door()
    message = {"message_id": "billing-4711", "account": "acme", "task": WHOSE, "kwargs": {"label": "invoice"}}
    produce(message)
    produce(message)  # the producer sent it twice (or it was redelivered): the same id
    produce({**message, "message_id": "billing-4712", "args": []})
    wait_for(lambda: DoorMessage.objects.count() == 2, timeout=60, message="two message ids recorded")
    wait_for(lambda: in_queue(amqp.queue_name("door")) == 0, timeout=30, message="the door queue to drain")
    consumer.stop()
    assert in_queue(amqp.queue_name("door")) == 0  # all three acknowledged, none given back
    calls = TaskCall.objects.order_by("enqueued_at")
    assert [(c.task_path, c.account_id, c.arguments) for c in calls] == [
        (WHOSE, account.pk, {"args": [], "kwargs": {"label": "invoice"}})] * 2
    assert not DeadLetter.objects.exists()


MALFORMED = {
    "not-json": (b"{this is not json", "not JSON"),
    "missing-account": ({"message_id": "missing-account", "task": ECHO}, "missing field(s): account"),
    "unknown-account": ({"message_id": "unknown-account", "account": "nobody", "task": ECHO},
                        "no active account"),
    "unknown-task": ({"message_id": "unknown-task", "account": "acme", "task": "os.system"},
                     "names no task the door accepts"),
    "arguments-over-limit": ({"message_id": "arguments-over-limit", "account": "acme", "task": ECHO,
                              "args": ["x" * 500]}, "more than the 200 allowed"),
    "wrong-type": ({"message_id": "wrong-type", "account": "acme", "task": ECHO, "args": {"a": 1}},
                   "field args must be a JSON array, got object"),
    "wrong-arguments": ({"message_id": "wrong-arguments", "account": "acme", "task": WHOSE, "args": [1, 2, 3]},
                        "the arguments do not fit the task"),
}


def test_each_malformed_kind_is_dead_lettered_with_its_reason_and_reaches_no_worker(start_door, account, settings):
    AccountFactory(slug="globex")
    for message_id, (body, _reason) in MALFORMED.items():
        produce(body, message_id=message_id)
    produce({"message_id": "fine", "account": "globex", "task": ECHO, "args": [1]})
    consumer = start_door()
    wait_for(lambda: DeadLetter.objects.count() == len(MALFORMED) and DoorMessage.objects.exists(), timeout=60,
             message="every malformed message dead-lettered and the good one recorded")
    consumer.stop()

    reasons = dict(DeadLetter.objects.values_list("message_id", "reason"))
    for message_id, (_body, reason) in MALFORMED.items():
        assert reason in reasons[message_id], (message_id, reasons[message_id])
    # Nothing of theirs was stored or sent: the only call is the good message's.
    assert list(TaskCall.objects.values_list("account__slug", flat=True)) == ["globex"]
    # Every one waits in the dead-letter queue, nothing is left in the door's own.
    assert in_queue(amqp.queue_name("door") + amqp.DEAD_SUFFIX) == len(MALFORMED)
    assert in_queue(amqp.queue_name("door")) == 0
    # An operator reads them in the admin and counts them in /metrics.
    settings.FAIRSHARE = {**settings.FAIRSHARE, "METRICS_ALLOWED_NETWORKS": "127.0.0.1/32"}
    metrics = Client(REMOTE_ADDR="127.0.0.1").get("/metrics").content.decode()
    assert f'fairshare_dead_letters_total{{queue="{amqp.queue_name("door")}"}} {len(MALFORMED)}.0' in metrics


def test_the_consumer_killed_between_recording_and_acknowledging_creates_nothing_new(start_door, account, tmp_path):
    marker = tmp_path / "door-fault"
    first = start_door(FAIRSHARE_FAULT="door_before_ack", FAIRSHARE_FAULT_MARKER=str(marker))
    produce({"message_id": "once", "account": "acme", "task": ECHO, "args": ["a"]})
    wait_for(marker.exists, timeout=60, message="the consumer to die before its acknowledgement")
    wait_for(lambda: not first.alive(), timeout=10, message="the consumer to be gone")
    first.finish(time.monotonic())
    assert DoorMessage.objects.count() == TaskCall.objects.count() == 1  # recorded, not acknowledged

    second = start_door()  # the message comes again (its consumer's connection died)
    wait_for(lambda: in_queue(amqp.queue_name("door")) == 0, timeout=60, message="the redelivery to be taken")
    second.stop()
    assert in_queue(amqp.queue_name("door")) == 0
    assert DoorMessage.objects.count() == TaskCall.objects.count() == 1
