"""The ORM broker delivers messages in the order they were sent (PostgreSQL). (Signed, as every
message is: the broker checks signatures, tests/scheduling/test_signatures.py.)"""
import pytest
from django.db import connection
from django_q.brokers import get_broker
from django_q.models import OrmQ
from django_q.signing import SignedPackage

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_message_sent_later_does_not_overtake_older_ones_after_a_busy_spell():
    broker = get_broker("fifo-test")
    for i in range(60):
        broker.enqueue(SignedPackage.dumps(f"{i:02d}:" + "x" * 600, compressed=False))
    # A busy spell: most messages are delivered and acknowledged, and (auto)vacuum reclaims
    # their space at the front of the table.
    for _ in range(40):
        [(task_id, _payload)] = broker.dequeue()
        broker.acknowledge(task_id)
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM {OrmQ._meta.db_table}")
    broker.enqueue(SignedPackage.dumps("late:"))

    delivered = []
    while broker.queue_size():
        task = broker.dequeue()
        [(task_id, payload)] = task
        broker.acknowledge(task_id)
        delivered.append(SignedPackage.loads(payload).split(":")[0])
    assert delivered == [f"{i:02d}" for i in range(40, 60)] + ["late"]
