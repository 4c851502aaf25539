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
    budgets 0012) are inlined: the plan a prepared statement settles on shows their tables, never a
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


def test_a_day_the_statistics_do_not_know_yet_reads_one_ledger_row_per_lookup():
    """At a budget day's start the planner's statistics know none of its rows (until autovacuum
    analyzes a table whose history is many days long), so a lookup of one account's row of the day
    looks like one row by either index on the day: each must read one row (the day's index carries
    the account and queue, budgets.models.UsageDay), never all of the day's rows — for every
    settlement, and for each of 10,000 budgets a page shows."""
    import datetime as dt

    from budgets.models import Account, UsageDay

    accounts = Account.objects.bulk_create([Account(slug=f"s{i}", name=f"s{i}") for i in range(2000)])
    yesterday, today = dt.date(2026, 12, 4), dt.date(2026, 12, 5)
    UsageDay.objects.bulk_create([UsageDay(account=a, queue="default", day=yesterday) for a in accounts])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE budgets_usageday")
        UsageDay.objects.bulk_create([UsageDay(account=a, queue="default", day=today) for a in accounts])
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) SELECT * FROM budgets_usageday "
                       "WHERE account_id = %s AND queue = 'default' AND day = %s", [accounts[-1].pk, today])
        (plan,) = cursor.fetchone()[0]
    scan = plan["Plan"]
    assert scan["Node Type"] == "Index Scan" and scan["Actual Rows"] == 1, scan
    assert scan.get("Rows Removed by Filter", 0) == 0, scan
