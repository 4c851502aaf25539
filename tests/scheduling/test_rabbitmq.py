"""The RabbitMQ broker on a real server (FAIRSHARE_TEST_RABBITMQ_URL), with real `qcluster` workers:
jobs run and are acknowledged, undecodable messages and unknown jobs are dead-lettered with their
reason, and a message whose consumer died is delivered again."""
import os
import signal
import subprocess

import pika
import pytest
from django_q.brokers import get_broker
from django_q.signing import SignedPackage

from scheduling import amqp
from scheduling.models import DeadLetter, Outcome, TaskRun
from scheduling.rabbitmq import RabbitMQ
from scheduling.rabbitmq_pusher import Consumer
from scheduling.runtime import RUNNER, enqueue
from tests.conftest import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]


def _ready_and_unacked(queue: str) -> int:
    """Messages in the queue, delivered or not (a passive look from a connection of the test's own)."""
    connection = amqp.connect()
    try:
        return connection.channel().queue_declare(amqp.queue_name(queue), passive=True).method.message_count
    finally:
        connection.close()


def test_jobs_run_through_rabbitmq_and_are_acknowledged(rabbitmq, account, beating_workers, start_cluster):
    broker = get_broker("default")
    assert isinstance(broker, RabbitMQ)
    sent = [enqueue(job="tests.noop", account=account.pk, ref=f"0/{i}") for i in range(20)]
    # What the account's cap let through waits in the queue, persistent and confirmed (the rest is held).
    assert broker.queue_size() == len([s for s in sent if s is not None]) > 0
    cluster = start_cluster("default", **rabbitmq.env)
    wait_for(lambda: TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).count() == 20, timeout=60,
             message="20 runs to succeed")
    # Each was acknowledged once its run was recorded: nothing left, delivered or not.
    wait_for(lambda: _ready_and_unacked("default") == 0, timeout=10, message="every message acknowledged")
    cluster.stop()
    assert _ready_and_unacked("default") == 0  # and the graceful stop gave nothing back
    assert TaskRun.objects.count() == 20


def test_bad_messages_are_dead_lettered_with_their_reason_and_never_run(rabbitmq, account, start_cluster,
                                                                       admin_client):
    publisher = amqp.Publisher.get()
    queue = amqp.queue_name("default")
    publisher.publish(queue, b"not a signed task", message_id="garbage-1")
    unknown = SignedPackage.dumps({"id": "x", "name": "x", "func": RUNNER, "args": (
        {"v": 2, "job": "no.such.job", "account": account.pk, "ref": "r", "priority": 0},), "kwargs": {},
        "started": None})
    publisher.publish(queue, unknown, message_id="unknown-job-1")
    enqueue(job="tests.noop", account=account.pk, ref="0/good")
    cluster = start_cluster("default", **rabbitmq.env)
    wait_for(lambda: DeadLetter.objects.count() == 2 and TaskRun.objects.exists(), timeout=60,
             message="two dead letters and the good job's run")
    reasons = dict(DeadLetter.objects.values_list("message_id", "reason"))
    assert "does not decode" in reasons["garbage-1"]
    assert "unknown job" in reasons["unknown-job-1"]
    # Nothing reached a worker but the good job; both bad messages wait in the dead-letter queue.
    assert list(TaskRun.objects.values_list("ref", flat=True)) == ["0/good"]
    cluster.stop()
    connection = amqp.connect()
    dead = connection.channel().queue_declare(queue + amqp.DEAD_SUFFIX, passive=True).method.message_count
    connection.close()
    assert dead == 2
    # An operator reads why in the admin.
    page = admin_client.get("/admin/scheduling/deadletter/").content.decode()
    assert "unknown job" in page and "does not decode" in page


def test_a_message_whose_pool_was_killed_is_delivered_again(rabbitmq, account, start_cluster):
    """The whole pool SIGKILLed mid-run: its connection dies and the server requeues the message
    at once (no `retry` to wait for); the next pool runs it."""
    enqueue(job="tests.sleep", account=account.pk, ref="3000/long")
    first = start_cluster("default", **rabbitmq.env)
    wait_for(lambda: TaskRun.objects.filter(outcome=Outcome.RUNNING).exists(), timeout=60,
             message="the run to start")
    os.killpg(first.pid, signal.SIGKILL)
    first.finish(0)
    second = start_cluster("default", **rabbitmq.env)
    wait_for(lambda: TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).exists(), timeout=60,
             message="the redelivered message to run")
    second.stop()
    assert _ready_and_unacked("default") == 0


def test_publish_is_persistent_to_a_durable_quorum_queue(rabbitmq):
    get_broker("default").enqueue("payload")
    connection = amqp.connect()
    channel = connection.channel()
    method, properties, body = channel.basic_get(amqp.queue_name("default"), auto_ack=False)
    assert body == b"payload" and properties.delivery_mode == pika.DeliveryMode.Persistent.value
    channel.basic_nack(method.delivery_tag, requeue=True)
    # Declaring it as anything but a durable quorum queue is refused: that is what it is.
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        channel.queue_declare(amqp.queue_name("default"), durable=False)
    connection.close()


def test_metrics_healthz_and_the_dashboard_read_the_rabbitmq_queues(rabbitmq, account, beating_workers):
    """The queue figures (/metrics, /healthz, the dashboard's queue panel: scheduling.liveness) on RabbitMQ."""
    from django.test import Client

    from scheduling.liveness import queue_health
    from tests.scheduling.test_ops_endpoints import beat

    for i in range(2):
        enqueue(job="tests.noop", account=account.pk, ref=f"0/{i}")
    waiting = get_broker("default").queue_size()
    assert waiting > 0
    assert {h.queue: h.depth for h in queue_health()} == {"default": waiting, "exports": 0}
    metrics = Client().get("/metrics").content.decode()
    assert f'fairshare_queue_depth{{queue="default"}} {waiting}.0' in metrics
    beat("default")
    beat("exports")
    response = Client().get("/healthz")
    assert response.status_code == 200, response.json()


def test_a_dead_workers_copied_delivery_is_dropped_once_it_is_acknowledged_after_all(rabbitmq):
    """A worker died after its run ended: the pusher copies its delivery to go again later, then
    the dead worker's sentinel hands the result in (scheduling.deaths) and the monitor acknowledges
    it. The copy is dropped when it comes: the finished task does not run again."""
    name = amqp.queue_name("default")
    get_broker("default").enqueue(SignedPackage.dumps({"id": "done", "name": "done", "func": "math.floor",
                                                       "args": (1,)}))
    consumer = Consumer(name, prefetch=1)
    try:
        def delivered():
            consumer.connection.process_data_events(time_limit=0.2)
            return consumer.delivered
        [(ack_id, _)] = wait_for(delivered, timeout=10, message="the delivery")
        consumer.delivered = []
        gone = subprocess.Popen(["true"])
        gone.wait()
        consumer.taken(ack_id, gone.pid)  # its worker, now dead
        consumer.requeue_orphans(after_s=1)  # copied, to come again in a second
        consumer.ack(ack_id)  # the result handed in for the dead worker, after all

        def copy_came():
            consumer.connection.process_data_events(time_limit=0.2)
            return not consumer.withdrawn
        wait_for(copy_came, timeout=15, message="the copy to come")
        consumer.connection.process_data_events(time_limit=0.5)
        assert consumer.delivered == [] and _ready_and_unacked("default") == 0
    finally:
        consumer.close()
