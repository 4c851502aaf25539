"""django-q2's ORM broker, delivering in the order messages were sent.

The stock ORM broker takes "the first" due row with no ORDER BY. On PostgreSQL that is the
first row in the table's physical order, and a message inserted after others were acknowledged
(and their space reclaimed by vacuum) goes to the front of the table: a held job that one
account's settlement releases overtakes the messages other accounts sent long before, and a busy
account can keep them waiting indefinitely (SPEC §4: a flood from one account must not delay
another account's jobs). Dequeuing by id keeps the doorbells in the order they were rung.
"""
from django_q.brokers.orm import ORM


class FifoORM(ORM):
    @staticmethod
    def get_connection(list_key: str | None = None):
        # Every read of the broker is in send order; update() and delete() ignore the ordering.
        return ORM.get_connection(list_key).order_by("id")
