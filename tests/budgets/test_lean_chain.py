"""The lean chain: an account's run is recorded by its admission, in the same transaction as its
slot, and completed by its settlement; what happens to that record when the admission fails after
making it; and what a run and a hand-off cost in statements (counts, not timings)."""
import json
import select

import psycopg
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from budgets import clock
from budgets import ledger
from budgets.models import Budget, Reservation, UsageDay
from scheduling.envelope import Envelope
from scheduling.models import DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue, enqueue_many, execute
from tests.conftest import wait_for

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("beating_workers")]


def test_a_run_whose_admission_failed_after_recording_it_is_still_recorded_and_charges_nothing(
    account, monkeypatch,
):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)

    def broken_slot(**kwargs):
        raise RuntimeError("the database refused the slot")

    monkeypatch.setattr(ledger, "activate", broken_slot)
    execute(Envelope(job="tests.noop", account=account.pk, ref="lean/1").to_message())

    # The admission's transaction (with the run's insert) was rolled back; the run is recorded
    # all the same, as failed, and holds no slot and no CPU.
    run = TaskRun.objects.get(ref="lean/1")
    assert (run.outcome, run.error_class, run.account_id) == (Outcome.FAILED, "RuntimeError", account.pk)
    assert run.finished_at is not None
    assert not Reservation.objects.exists()
    assert not UsageDay.objects.filter(cpu_reserved_ms__gt=0).exists()


def statements(queries) -> list[str]:
    """The SQL statements sent, without transaction control (Django logs BEGIN/COMMIT too)."""
    return [q["sql"] for q in queries if q["sql"].strip().upper() not in {"BEGIN", "COMMIT", "ROLLBACK"}]


def commits(queries) -> int:
    return sum(1 for q in queries if q["sql"].strip().upper() == "COMMIT")


def test_an_accounts_run_costs_two_statements_and_no_transaction(account):
    """What bench/budget_overhead.py reports, held as a count: admission (the slot made active,
    CPU reserved and the run recorded in one statement, no lock taken first) and settlement (the
    ledger + the run's complete record in a statement of its own, no lock), nothing after: the
    look for work held since is the worker's watcher's, once per tick (test_wakeups). (The day's
    first run admits under the lock: it creates the day's ledger row.)"""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=4)
    for ref in ("lean/first-of-the-day", "lean/count"):  # the day's first run also creates its ledger row
        assert enqueue(job="tests.noop", account=account.pk, ref=ref) is not None
        with CaptureQueriesContext(connection) as queries:
            execute(Envelope(job="tests.noop", account=account.pk, ref=ref).to_message())

    assert (len(statements(queries)), commits(queries)) == (2, 0), statements(queries)
    run = TaskRun.objects.get(ref="lean/count")
    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, 1) and run.finished_at >= run.started_at
    assert not Reservation.objects.exists()
    assert UsageDay.objects.get().runs == 2


def test_a_hand_off_cycle_costs_two_statements_and_no_transaction(account):
    """A run that came from the holding area settles and passes its slot on to the next held job,
    claimed and admitted (one statement, no lock), which then starts (one statement: the claim
    completes), per run of a capped backlog, in FIFO order."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=1)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day())  # not the day's first run
    refs = [f"lean/h{i}" for i in range(5)]
    assert [ref for ref, sent in zip(refs, enqueue_many(job="tests.noop", work=[(account.pk, r) for r in refs]))
            if sent] == refs[:1]

    with CaptureQueriesContext(connection) as queries:
        execute(Envelope(job="tests.noop", account=account.pk, ref=refs[0]).to_message())

    runs = list(TaskRun.objects.order_by("started_at").values_list("ref", "outcome"))
    assert runs == [(ref, Outcome.SUCCEEDED) for ref in refs]
    # The first admission (1 statement) stands alone. The first run came through the broker: its
    # settlement charges (1), sees work held and hands the slot off under the lock (lock, state,
    # claim and admission: one transaction), and the next job starts (1). Each run that came from
    # the holding area then passes its slot on in its own statement and the next job starts (1);
    # the last finds nothing held (its look after the commit is the watcher's) (1).
    assert (len(statements(queries)), commits(queries)) == (1 + (1 + 3 + 1) + 3 * 2 + 1, 1), statements(queries)
    assert not Reservation.objects.exists() and not DeferredTask.objects.exists()
    usage = UsageDay.objects.get()
    assert (usage.runs, usage.cpu_reserved_ms) == (5, 0)


def prepared_statements() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


@pytest.mark.parametrize("prepared", [True, False])
def test_the_chain_prepares_its_own_statements_once_per_connection_and_only_them(account, settings, prepared):
    """scheduling.db: the admission and settlement statements are prepared on the worker's
    connection (FAIRSHARE["PREPARED_STATEMENTS"]), Django's own queries never; the query log
    still shows each statement with its values."""
    settings.FAIRSHARE = {**settings.FAIRSHARE, "PREPARED_STATEMENTS": prepared}
    connection.close()  # a new session: nothing prepared yet
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=4)
    for i in range(3):
        with CaptureQueriesContext(connection) as queries:
            execute(Envelope(job="tests.noop", account=account.pk, ref=f"prep/{i}").to_message())
        assert f"'prep/{i}'" in " ".join(statements(queries))  # logged with its values

    found = prepared_statements()
    settlement = [s for s in found if "DELETE FROM budgets_reservation" in s]
    if prepared:
        # Prepared once, then reused by the next runs (the same text three times over).
        assert len(settlement) == 1 and "$1" in settlement[0], found
        assert any("FOR UPDATE" in s for s in found) and any("INSERT INTO scheduling_taskrun" in s for s in found)
        assert not any("django_q" in s or '"budgets_account"' in s for s in found), found
    else:
        assert found == []
    assert TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).count() == 3


def test_a_task_spares_the_health_check_ping_only_while_its_connection_is_quiet(account, monkeypatch):
    """scheduling.connections.trust_quiet_connection: after django-q2's close_old_connections() a connection
    that served the previous task moments ago and has nothing on its socket is used without
    Django's `SELECT 1` ping; one idle for longer, or whose session the server ended (its goodbye
    is waiting on the socket), gets the ping; a dead one fails it and is replaced, and the task
    runs on the new connection."""
    from django.db import close_old_connections

    from scheduling import connections as db_connections

    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=4)
    execute(Envelope(job="tests.noop", account=account.pk, ref="quiet/first").to_message())
    close_old_connections()
    assert not connection.health_check_done
    db_connections.trust_quiet_connection()
    assert connection.health_check_done  # the ping is spared: it served a task moments ago

    close_old_connections()
    monkeypatch.setattr(db_connections, "TRUST_QUIET_FOR_S", 0.0)  # as if idle for long: it may be dropped silently
    db_connections.trust_quiet_connection()
    assert not connection.health_check_done
    monkeypatch.undo()

    pid = connection.connection.info.backend_pid
    close_old_connections()
    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k in ("dbname", "user", "password", "host", "port")},
                         autocommit=True) as other:
        other.execute("SELECT pg_terminate_backend(%s)", [pid])
    fd = connection.connection.fileno()
    wait_for(lambda: select.select([fd], [], [], 0)[0], timeout=10, message="the server's goodbye")
    db_connections.trust_quiet_connection()
    assert not connection.health_check_done  # Django pings, finds it dead and reconnects

    execute(Envelope(job="tests.noop", account=account.pk, ref="quiet/after-terminate").to_message())
    assert TaskRun.objects.get(ref="quiet/after-terminate").outcome == Outcome.SUCCEEDED
    assert connection.connection.info.backend_pid != pid


def _reservation_rows_read(sql: str) -> int:
    """Rows the statement reads from budgets_reservation (EXPLAIN ANALYZE: rows each scan of the
    table returned plus those its filter removed, over all its loops)."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql)
        plan = cursor.fetchone()[0]
    plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]

    def walk(node) -> int:
        own = 0
        if node.get("Relation Name") == Reservation._meta.db_table:
            own = (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) * node.get("Actual Loops", 1)
        return own + sum(walk(child) for child in node.get("Plans", []))

    return walk(plan)


def test_a_start_does_not_read_the_accounts_backlog(account, beating_workers):
    """A job's own dispatched slot is found by its (job, ref); the slots taken are counted only for
    a job without one. With 300 of the account's jobs dispatched, the admission's state read of a
    job holding its slot reads a row or two of them; a job without one still counts them all."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10**6, max_concurrent=1000)
    beating_workers(300)  # workers to start them all: every job goes to the broker
    enqueue_many(job="tests.noop", work=[(account.pk, f"backlog/{i}") for i in range(300)])
    day = clock.budget_day()

    def state_read(ref: str):
        envelope = Envelope(job="tests.noop", account=account.pk, ref=ref)
        state = ledger.standing(account_id=account.pk, queue="default", day=day, envelope=envelope)
        with CaptureQueriesContext(connection) as queries:
            ledger.standing(account_id=account.pk, queue="default", day=day, envelope=envelope)
        sql = queries.captured_queries[-1]["sql"]  # as sent, its parameters in place
        return state, _reservation_rows_read(sql)

    own, rows_read = state_read("backlog/150")
    assert own.own_slot is not None and own.in_flight is None
    assert rows_read <= 2

    other, rows_read = state_read("not-dispatched")
    assert other.own_slot is None and other.in_flight == 300 and other.free_slots == 700
    assert rows_read >= 300
