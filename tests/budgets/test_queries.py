"""The ledger's statements as budgets/ledger/queries.sql keeps them (scheduling.db.load_queries):
whole, named, within psycopg's conversion cache, their shared rules inlined by PostgreSQL, and
their writes of the kernel's run record naming every column it needs."""
import re

import pytest
from django.db import connection

from budgets.ledger.reads import QUERIES
from scheduling.models import TaskRun

pytestmark = pytest.mark.django_db

NAMES = {"lock", "standing", "dispatch_or_hold", "admit_at_once", "activate", "claim", "start_admitted",
         "reserve_more", "grow", "unadmit", "reclaim", "revive", "broker_waiting", "ready_accounts", "settle"}


def test_each_transition_is_one_named_statement_converted_once_per_process():
    """psycopg converts named placeholders on every execute and keeps the conversion only for
    statements up to 4,096 bytes and 50 parameters: the loader leaves each statement's comments
    out, so that every one, the settlement with its pass-on the longest, is converted once."""
    assert set(QUERIES) == NAMES
    for name, statement in QUERIES.items():
        assert "--" not in statement and len(statement.encode()) <= 4096, (name, len(statement.encode()))
        assert len(set(re.findall(r"%\((\w+)\)s", statement))) <= 50, name


@pytest.mark.parametrize("name", sorted(NAMES))
def test_its_generic_plan_calls_no_rule_function(name):
    """The rules the statements share (SQL functions fairshare_*, migrations scheduling 0023 and
    budgets 0012, 0013) are inlined: the plan a prepared statement settles on shows their tables, never a
    call (a call would hide its rows from the planner and cost a function call per row)."""
    statement = QUERIES[name]
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", statement)
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE rule_inlined AS {numbered}")
        try:
            args = f"({', '.join(['NULL'] * len(names))})" if names else ""
            cursor.execute(f"EXPLAIN (VERBOSE) EXECUTE rule_inlined {args}")
            plan = "\n".join(row[0] for row in cursor.fetchall())
        finally:
            cursor.execute("DEALLOCATE rule_inlined")
            cursor.execute("RESET plan_cache_mode")
    assert "fairshare_" not in plan, plan
    assert "Function Scan" not in plan, plan


def test_a_run_recorded_by_a_statement_gets_every_column_the_model_has():
    """The statements that record a run as it starts list TaskRun's columns themselves: a column the
    model gains without a database default must be added there (a nullable one may be left out)."""
    needed = {f.column for f in TaskRun._meta.concrete_fields if not f.primary_key and not f.null}
    inserts = re.findall(r"INSERT INTO scheduling_taskrun \(([^)]*)\)", " ".join(QUERIES.values()))
    assert len(inserts) == 4  # admit_at_once, activate, claim, settle
    for columns in inserts:
        assert needed <= {c.strip() for c in columns.split(",")}, needed - {c.strip() for c in columns.split(",")}
