"""The ledger's statements as budgets/ledger/queries.sql keeps them (scheduling.db.load_queries):
whole, named, within psycopg's conversion cache, their shared rules inlined by PostgreSQL, and
their writes of the kernel's run record naming every column it needs."""
import datetime as dt
import re

import pytest
from django.db import connection
from django.db.models import NOT_PROVIDED
from django.utils import timezone

from budgets import clock, ledger
from budgets.ledger.reads import QUERIES, broker_window
from budgets.models import Reservation, ReservationStatus
from scheduling.envelope import Envelope
from scheduling.liveness import heard_since
from scheduling.models import TaskRun, WorkerHeartbeat
from tests.scheduling.test_held_work_cost import generic_rows_read, rows_read

pytestmark = pytest.mark.django_db
# A call of a rule function (fairshare_*(...)); not the usage log's session setting fairshare_usage.events.
RULE_CALL = re.compile(r"\bfairshare_\w+\(")

NAMES = {"lock", "standing", "dispatch_or_hold", "admit_at_once", "activate", "claim", "start_admitted",
         "reserve_more", "grow", "unadmit", "reclaim", "revive", "broker_waiting", "idle_workers", "ready_accounts",
         "settle", "release"}


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
    assert not RULE_CALL.search(plan), plan
    assert "Function Scan" not in plan, plan


def test_a_run_recorded_by_a_statement_gets_every_column_the_model_has():
    """The statements that record a run as it starts list TaskRun's columns themselves: a column the
    model gains without a database default must be added there (a nullable one, or one with its
    `db_default`, may be left out)."""
    needed = {f.column for f in TaskRun._meta.concrete_fields
              if not f.primary_key and not f.null and f.db_default is NOT_PROVIDED}
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


HISTORY = 100_000


def test_the_enqueue_checks_count_of_idle_workers_reads_the_live_workers_and_the_slots_taken_not_history(account):
    """`idle_workers` (every enqueue): 100,000 heartbeats of workers gone (recycled processes, kept
    until the prune) and 100,000 slots that are not the queue's in flight (the other queue's,
    reclaimed ones) beside 3 live workers and 2 slots taken. Its one statement reads those 3 and 2
    index entries (heartbeat_live, reservation_in_flight), in the plan for its values and in the
    generic plan a prepared statement settles on."""
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {WorkerHeartbeat._meta.db_table} (worker, queue, seen_at) "
            "SELECT 'gone:' || i, CASE WHEN i %% 2 = 0 THEN 'default' ELSE 'exports' END, %s - i * interval '1 second' "
            "FROM generate_series(1, %s) AS i", [now - dt.timedelta(hours=1), HISTORY])
        cursor.execute(
            f"INSERT INTO {Reservation._meta.db_table} (account_id, queue, day, job, ref, worker, status, "
            "cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms, created_at, lease_expires_at) "
            "SELECT %s, CASE WHEN i %% 2 = 0 THEN 'exports' ELSE 'default' END, %s, 'tests.noop', 'old-' || i, 'w', "
            "CASE WHEN i %% 2 = 0 THEN 'active' ELSE 'reclaimed' END, 0, 0, 0, %s, %s "
            "FROM generate_series(1, %s) AS i", [account.pk, clock.budget_day(), now, now, HISTORY])
    WorkerHeartbeat.objects.bulk_create([WorkerHeartbeat(worker=f"live:{i}", queue="default", seen_at=now)
                                         for i in range(3)])
    for ref in ("taken-1", "taken-2"):
        ledger.dispatch(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default",
                        day=clock.budget_day())
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    assert Reservation.objects.filter(status=ReservationStatus.DISPATCHED).count() == 2

    assert ledger.idle_workers(queue="default") == 1
    params = {"queue": "default", "live_since": heard_since()}
    tables = (WorkerHeartbeat._meta.db_table, Reservation._meta.db_table)
    for plan, read in (("custom", rows_read(QUERIES["idle_workers"], params, tables)),
                       ("generic", generic_rows_read(QUERIES["idle_workers"], params, tables))):
        assert read == {WorkerHeartbeat._meta.db_table: 3, Reservation._meta.db_table: 2}, (plan, read)
    # Every single enqueue asks it within `dispatch_or_hold`: the same 3 heartbeats, whatever history.
    check = {**params, **broker_window(), "account_id": account.pk, "day": clock.budget_day(),
             "job": "tests.noop", "ref": "new", "priority": 0, "lease": now, "created_at": now, "now": now}
    for plan, read in (("custom", rows_read(QUERIES["dispatch_or_hold"], check, tables)),
                       ("generic", generic_rows_read(QUERIES["dispatch_or_hold"], check, tables))):
        assert read[WorkerHeartbeat._meta.db_table] == 3, (plan, read)
        assert read[Reservation._meta.db_table] < 10, (plan, read)  # not the account's 100,000 other slots
