"""The outbox's statements (usage/queries.sql) on a large outbox: the relay's read and delete and
the monitoring's lag read the primary key's index from its low end, never the whole table (the
outbox grows while the log is down)."""
import json

import pytest
from django.db import connection

from usage.relay import QUERIES

pytestmark = pytest.mark.django_db

ROWS = 100_000


def analyzed(sql: str, params: dict) -> dict:
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params)
        return cursor.fetchone()[0][0]["Plan"]


def rows_read(node: dict) -> int:
    """Rows every scan of the plan produced (an index scan's rows are the entries it read)."""
    own = node.get("Actual Rows", 0) * node.get("Actual Loops", 1) if "Scan" in node["Node Type"] else 0
    return own + sum(rows_read(child) for child in node.get("Plans", ()))


def test_the_outbox_statements_read_a_bounded_number_of_rows_however_large_it_grows():
    with connection.cursor() as cursor:
        cursor.execute("INSERT INTO usage_usageevent (event_id, subject, body, created_at) "
                       "SELECT gen_random_uuid(), 'usage.default.1', '{\"v\": 1}', now() FROM generate_series(1, %s)",
                       [ROWS])
        cursor.execute("ANALYZE usage_usageevent")
        cursor.execute("SELECT min(id) FROM usage_usageevent")
        first = cursor.fetchone()[0]
    for name, params, bound in (("oldest", {"batch": 100}, 100), ("delete", {"ids": list(range(first, first + 100))}, 100),
                                ("lag", {}, 3)):
        plan = analyzed(QUERIES[name], params)
        shown = json.dumps(plan)
        assert "Seq Scan" not in shown and "usage_usageevent_pkey" in shown, (name, shown)
        assert rows_read(plan) <= bound, (name, rows_read(plan), shown)
