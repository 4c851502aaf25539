"""Held work costs nothing: every question asked about the holding area per task, per tick or per
pull reads a bounded number of rows whatever it holds (SPEC §4 "Held work costs nothing"). With
100,000 jobs held across 10,000 accounts (most of them out of budget until tomorrow, some jobs
waiting for their own time, one account's long line), each statement is EXPLAIN ANALYZEd and the rows it reads from
the holding area and its summary are counted: rows each scan returned plus those its filter
removed, over all its loops: the ledger's statements, and the holding area's ORM queries. The SQL also in
the generic plan a prepared statement settles on (scheduling.db prepares the hot statements), whose
estimates cannot see the parameters' values: a condition on a time parameter there reads as a
third of the table, and a statement whose generic plan looks dear is planned anew on every call."""
import datetime as dt
import json
import re
import uuid

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from budgets import clock as budget_clock
from budgets import ledger
from budgets.ledger import PassOn
from budgets.ledger.reads import QUERIES
from budgets.models import Account, Budget, Reservation, ReservationStatus, UsageDay
from scheduling import clock, db, holding
from scheduling.envelope import Envelope
from scheduling.metering import Meter
from scheduling.models import Backlog, DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.services import RunEnd
from tests.factories import AccountFactory

pytestmark = pytest.mark.django_db
# A call of a rule function (fairshare_*(...)); not the usage log's session setting fairshare_usage.events.
RULE_CALL = re.compile(r"\bfairshare_\w+\(")

HELD_TABLES = (DeferredTask._meta.db_table, Backlog._meta.db_table)
EXHAUSTED_ACCOUNTS, EACH = 9_997, 9  # 89,973 held until tomorrow
LONG_LINE = 9_027  # one account at its cap with a line this long
TIMED = 1_000  # retries waiting for their back-off, spread over accounts


def rows_read(statement: str, params, tables=HELD_TABLES) -> dict[str, int]:
    """Rows the statement reads from each of `tables` (the holding area's: EXPLAIN ANALYZE). Its
    plan calls none of the rules' SQL functions (fairshare_*): PostgreSQL inlined each."""
    with connection.cursor() as cursor:
        cursor.execute("EXPLAIN (ANALYZE, VERBOSE, FORMAT JSON) " + statement, params)
        plan = cursor.fetchone()[0]
    plan = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    assert not RULE_CALL.search(json.dumps(plan)), plan
    read = dict.fromkeys(tables, 0)

    def walk(node) -> None:
        if node.get("Relation Name") in read:
            read[node["Relation Name"]] += (node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)) \
                * node.get("Actual Loops", 1)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan)
    return read


def _pg_type(value) -> str:
    if value is None:
        return "unknown"  # PREPARE infers it from where the statement uses it
    for kind, name in ((bool, "boolean"), (int, "bigint"), (float, "float8"), (dt.datetime, "timestamptz"),
                       (dt.date, "date"), (uuid.UUID, "uuid")):
        if isinstance(value, kind):
            return name
    return "text"


def generic_rows_read(statement: str, params: dict, tables=HELD_TABLES) -> dict[str, int]:
    """`rows_read` of the statement's generic plan (prepared, plan_cache_mode force_generic_plan)."""
    names = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    numbered = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", statement)
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        cursor.execute(f"PREPARE held_work_cost ({', '.join(_pg_type(params[n]) for n in names)}) AS {numbered}")
    try:
        return rows_read(f"EXECUTE held_work_cost ({', '.join(['%s'] * len(names))})", [params[n] for n in names],
                         tables)
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE held_work_cost")
            cursor.execute("RESET plan_cache_mode")


def orm_rows_read(run) -> dict[str, int]:
    """`rows_read` of every statement `run()` sends (its ORM queries), summed."""
    with CaptureQueriesContext(connection) as queries:
        run()
    total = dict.fromkeys(HELD_TABLES, 0)
    for query in queries.captured_queries:
        if query["sql"].lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE", "WITH")):
            for table, n in rows_read(query["sql"], None).items():
                total[table] += n
    return total


def bulk_hold(rows: list[tuple[int, str, str, dt.datetime, dt.datetime | None]]) -> None:
    """(account, ref, reason, eligible_at, in_line_since) rows, straight into the table (the
    triggers count them, as for any insert)."""
    now = clock.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {DeferredTask._meta.db_table} (account_id, queue, job, ref, reason, eligible_at, created_at, "
            "in_line_since, deferrals, priority, claimed_by, envelope_version) "
            "SELECT a, 'default', 'tests.noop', r, reason, e, %s, l, 1, 0, '', 1 "
            "FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::timestamptz[], %s::timestamptz[]) AS t(a, r, reason, e, l)",
            [now, *map(list, zip(*rows))])


@pytest.fixture
def holding_area():
    """100,000 held jobs of 10,000 accounts: 9,997 out of budget until tomorrow (their lines
    blocked), one at its cap with a long line, 1,000 retries not due yet, and two light accounts
    with one job each in line (the only ones a free worker could take)."""
    now, tomorrow = clock.now(), budget_clock.next_reset()
    exhausted = Account.objects.bulk_create([Account(slug=f"x{i}", name=f"x{i}") for i in range(EXHAUSTED_ACCOUNTS)])
    capped, light, lighter = AccountFactory(slug="capped"), AccountFactory(slug="light"), AccountFactory(slug="lighter")
    Budget.objects.bulk_create([Budget(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
                                for account in [*exhausted, capped, light, lighter]])
    rows = [(a.pk, f"x-{a.pk}-{i}", DeferReason.BUDGET_EXHAUSTED, tomorrow, now) for a in exhausted for i in range(EACH)]
    rows += [(capped.pk, f"c-{i}", DeferReason.QUEUED_BEHIND, now, now) for i in range(LONG_LINE)]
    rows += [(exhausted[i % 10].pk, f"t-{i}", DeferReason.RETRY_BACKOFF, now + dt.timedelta(hours=1), None)
             for i in range(TIMED)]
    rows += [(light.pk, "l-0", DeferReason.CONCURRENCY_CAP, now, now), (lighter.pk, "l-1", DeferReason.CONCURRENCY_CAP, now, now)]
    bulk_hold(rows)
    Backlog.objects.filter(account__in=exhausted).update(blocked_until=tomorrow)  # as `holding.block` leaves them
    # The capped account runs at its cap: its line cannot go.
    ledger.dispatch(envelope=Envelope(job="tests.noop", account=capped.pk, ref="c-running"), queue="default",
                      day=budget_clock.budget_day())
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    assert DeferredTask.objects.count() == 100_002
    return {"capped": capped, "light": light, "lighter": lighter, "exhausted": exhausted[0], "now": now}


def test_each_question_about_held_work_reads_a_bounded_number_of_rows(holding_area):
    now, capped, light = holding_area["now"], holding_area["capped"], holding_area["light"]
    UsageDay.objects.create(account=light, queue="default", day=budget_clock.budget_day())
    # The capped account's slot counts as a message waiting for a worker, its job probed by key.
    broker = {"queue": "default", "broker_since": now + dt.timedelta(minutes=1), "broker_forgets": now - dt.timedelta(minutes=1)}
    claim = {**broker, "account_id": capped.pk, "queue": "default", "day": budget_clock.budget_day(), "worker": "w",
             "now": now, "claim_expires_at": now + dt.timedelta(seconds=30), "yield_to_broker": False,
             "slot_lease": now, "created_at": now, "usage_id": 0, "reserve_ms": 0,
             "run_started_at": now}
    # The line's first three jobs were claimed by a worker that died: their claims expired, their
    # slots still stand (the reclaim has not given them back), so a claim may not take them over.
    dead = list(DeferredTask.objects.filter(account=capped).order_by(*holding.LINE_ORDER)[:3])
    DeferredTask.objects.filter(pk__in=[d.pk for d in dead]).update(
        claimed_by="dead:1", claim_expires_at=now - dt.timedelta(minutes=1))
    Reservation.objects.bulk_create([Reservation(
        account=capped, queue="default", day=budget_clock.budget_day(), job=d.job, ref=d.ref, worker="dead:1",
        status=ReservationStatus.ACTIVE, lease_expires_at=now - dt.timedelta(minutes=1)) for d in dead])
    started = Reservation.objects.filter(account=capped, ref=dead[0].ref).get()
    checks = {
        # A claim of the first job of a 9,000-long line (budgets', as every ledger statement sends
        # it): past the three whose claimant's slot stands (one probe of its slot each), its next row.
        "claim": (QUERIES["claim"], claim),
        # A release of the line's first job to the broker, past the same (a slot probe each) and
        # the two claimed above: out of the holding area with a dispatched slot.
        "release": (QUERIES["release"], {"account_id": capped.pk, "queue": "default", "day": budget_clock.budget_day(),
                                         "now": now, "limit": 1, "lease": now, "created_at": now}),
        # A job admitted ahead starts: its claim completes, its slot locked (rows by key).
        "start": (QUERIES["start_admitted"], {"slot_id": started.pk, "job": dead[0].job, "ref": dead[0].ref,
                                     "worker": "dead:1"}),
        # "Which accounts could run now" (a pull's choice, the pulse's release): the light ones.
        "pull's choice": (QUERIES["ready_accounts"], {"queue": "default", "now": now, "limit": 4}),
        # "Could any account of the queue go now" (read with every settlement).
        "settlement's question": ("SELECT waiting FROM fairshare_any_ready(%(queue)s)", {"queue": "default", "now": now}),
        # "Could another account take a free worker" (read with every settlement: its slot then goes
        # by the fair order).
        "settlement's other question": ("SELECT others_waiting FROM fairshare_others_ready(%(account_id)s, %(queue)s)",
                                        {"queue": "default", "now": now, "account_id": capped.pk}),
        # An account's standing (every admission under the lock, every hand-off and release).
        "standing": (QUERIES["standing"], {"account_id": capped.pk, "queue": "default", "day": budget_clock.budget_day(),
                                  "job": "", "ref": "", "now": now, "wall_now": now}),
        # "Is a job sent to the broker waiting for a worker" (every enqueue, pass-on and release).
        "broker's question": (QUERIES["broker_waiting"], broker),
        # The enqueue check's common case for an account with a free slot and a job in line: the
        # new job joins the line behind it, while a job waits in the broker.
        "enqueue check": (QUERIES["dispatch_or_hold"], {**broker, "account_id": light.pk, "day": budget_clock.budget_day(),
                                               "job": "tests.noop", "ref": "new", "priority": 0, "lease": now,
                                               "created_at": now, "now": now, "live_since": now}),
    }
    for name, (statement, params) in checks.items():
        # A claim reads the claimed rows ahead in its line too, and probes the slot of each expired
        # one (counted here), and the slot it inserts: bounded by the claims in flight (workers), not
        # by the held jobs.
        tables, most = ((*HELD_TABLES, Reservation._meta.db_table), 17) if name in ("claim", "release") \
            else (HELD_TABLES, 10)
        for plan, read in (("custom", rows_read(statement, params, tables)),
                           ("generic", generic_rows_read(statement, params, tables))):
            assert sum(read.values()) <= most, (name, plan, read)
    # Neither claim took over a job whose claimant's slot stands (each claimed the next one).
    assert set(DeferredTask.objects.filter(account=capped, claimed_by="w").values_list("ref", flat=True)) == {
        f"c-{i}" for i in (3, 4)}
    assert DeferredTask.objects.get(ref="new").reason == DeferReason.QUEUED_BEHIND  # the enqueue check held it

    # The due scan (the pulse's, every second): 1,000 retries wait for their own time, none due.
    due = DeferredTask.objects.filter(in_line_since__isnull=True, message__isnull=True, eligible_at__lte=now)
    assert sum(orm_rows_read(lambda: list(due.order_by("account_id", "queue", "eligible_at")[:1000])).values()) == 0
    # The pulse's let-go: 9,997 lines held up until tomorrow, none due; when the first one's time
    # comes (when the pulse ticks next), the first entry.
    assert sum(orm_rows_read(lambda: holding.unblock_due(now)).values()) == 0
    assert sum(orm_rows_read(holding.next_unblock).values()) == 1


def test_the_settlements_orm_question_reads_a_bounded_number_of_rows_too(holding_area):
    """"Anything of this account's in line", asked through the ORM by a settlement: its Backlog row."""
    read = orm_rows_read(lambda: holding.in_line(account_id=holding_area["capped"].pk, queue="default"))
    assert sum(read.values()) <= 10, read


def test_a_rate_limits_window_reads_no_more_than_its_limit_of_history():
    """A rate-limited account's standing reads its window (its latest starts) from TaskRun's index
    no further than its limit, however many runs it has on record, in the window or before it."""
    account = AccountFactory()
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1,
                          rate_starts=50, rate_period_s=60)
    now = clock.now()
    TaskRun.objects.bulk_create(
        [TaskRun(account=account, queue="default", job="tests.noop", ref=f"r{i}", outcome=Outcome.SUCCEEDED,
                 started_at=now - dt.timedelta(seconds=(i % 20_000) * 0.002 if i < 20_000 else 3600 + i))
         for i in range(30_000)], batch_size=5_000)
    with connection.cursor() as cursor:
        cursor.execute(f"ANALYZE {TaskRun._meta.db_table}")
    params = {"account_id": account.pk, "queue": "default", "day": budget_clock.budget_day(), "job": "", "ref": "",
              "now": now, "wall_now": now}
    read = rows_read(QUERIES["standing"], params, tables=(TaskRun._meta.db_table,))
    assert read[TaskRun._meta.db_table] <= 2 * 50 + 4, read  # the count's 50 and the oldest-in-window's 50
    state = ledger.standing(account_id=account.pk, queue="default", day=budget_clock.budget_day())
    assert state.rate_full and state.recent_starts == 50 and state.rate_frees_at is not None


def test_a_settlement_that_passes_its_slot_on_carrying_its_charge_reads_a_bounded_number_of_rows(
        holding_area, monkeypatch):
    """The pass-on (the settlement's one statement, budgets.ledger.settling) of a run of the capped
    account, whose 9,000-long line is first in its own order: it claims the line's next job, and,
    carrying the run's charge on, looks its usage row up by key among 10,000 accounts' instead of
    charging it. What it reads from the holding area and the usage rows, as the ledger sends it."""
    capped, today = holding_area["capped"], budget_clock.budget_day()
    UsageDay.objects.bulk_create([UsageDay(account_id=pk, queue="default", day=today, cpu_used_ms=100_000)
                                  for pk in Account.objects.exclude(pk=capped.pk).values_list("pk", flat=True)])
    UsageDay.objects.create(account=capped, queue="default", day=today, cpu_reserved_ms=1000)
    slot = Reservation.objects.get(account=capped)
    Reservation.objects.filter(pk=slot.pk).update(status=ReservationStatus.ACTIVE, cpu_reserved_ms=1000, worker="w")
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    tables = (*HELD_TABLES, UsageDay._meta.db_table)
    reads, send = {}, db.fetch_one

    def explain_then_send(statement: str, params: dict):
        if statement is QUERIES["settle"]:  # the settlement's, ahead of sending it
            for plan, read_rows in (("custom", rows_read), ("generic", generic_rows_read)):
                with transaction.atomic():  # EXPLAIN ANALYZE runs it: undone
                    reads[plan] = read_rows(statement, params, tables)
                    transaction.set_rollback(True)
        return send(statement, params)

    monkeypatch.setattr(db, "fetch_one", explain_then_send)
    meter = Meter(cpu_ms=40, wall_ms=50)
    charged = ledger.charge(slot_id=slot.pk, account_id=capped.pk, queue="default", meter=meter, cap_hit=False,
                              end=RunEnd(meter=meter, outcome=Outcome.SUCCEEDED), now=clock.now(),
                              pass_on=PassOn(worker="w", day=today, lease_s=30))

    assert charged.passed.envelope.ref == "c-0"
    assert Reservation.objects.get(account=capped).carried_runs == 1  # it carried the charge on
    assert UsageDay.objects.get(account=capped).cpu_reserved_ms == 1000  # and wrote no usage row
    for plan, read in reads.items():
        # The line's first rows (one claimed), Backlog's ready lines, the usage row by key.
        assert sum(read[t] for t in HELD_TABLES) <= 15 and read[UsageDay._meta.db_table] <= 2, (plan, read)
        # Backlog only for the pass-on's own question (another account's turn?): what a settlement
        # that did not pass on reads after its charge (8 rows here) is not read.
        assert read[Backlog._meta.db_table] <= 4, (plan, read)
    assert set(reads) == {"custom", "generic"}
