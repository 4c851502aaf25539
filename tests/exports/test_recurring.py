"""Recurring exports: one export per period however often the schedule fires, periods in the
account's time zone, and the same budgets as any other work."""
import datetime as dt
import threading
from zoneinfo import ZoneInfo

import pytest
from django.db import connections
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets import clock
from budgets.models import Account, Budget, Membership, UsageDay
from exports.models import ExportRecord, ExportSchedule, ExportStatus, SchedulePeriod
from exports.recurring import run_export_schedules, schedule_period
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import enqueue

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]

AMSTERDAM, NEW_YORK, TOKYO = ZoneInfo("Europe/Amsterdam"), ZoneInfo("America/New_York"), ZoneInfo("Asia/Tokyo")
D = dt.date


def local(zone: ZoneInfo, *args, fold: int = 0) -> dt.datetime:
    return dt.datetime(*args, tzinfo=zone, fold=fold)


def period_at(zone: ZoneInfo, period: str, at: dt.time, now: dt.datetime) -> tuple[dt.date, dt.date]:
    schedule = ExportSchedule(account=Account(slug="x", timezone=str(zone)), period=period, at_time=at)
    return schedule_period(schedule, now)


@pytest.mark.parametrize(
    ("zone", "period", "at", "now", "expected"),
    [
        # Daily at 00:30 in Amsterdam (CET, UTC+1): the local date decides, not the UTC one.
        (AMSTERDAM, "daily", dt.time(0, 30), local(AMSTERDAM, 2026, 1, 15, 0, 29, 59), (D(2026, 1, 13), D(2026, 1, 13))),
        (AMSTERDAM, "daily", dt.time(0, 30), local(AMSTERDAM, 2026, 1, 15, 0, 30), (D(2026, 1, 14), D(2026, 1, 14))),
        # Daily at 22:00 in New York (EST): it is already the 15th in UTC.
        (NEW_YORK, "daily", dt.time(22), local(NEW_YORK, 2026, 1, 14, 21, 59, 59), (D(2026, 1, 12), D(2026, 1, 12))),
        (NEW_YORK, "daily", dt.time(22), local(NEW_YORK, 2026, 1, 14, 22, 0), (D(2026, 1, 13), D(2026, 1, 13))),
        # Daily at 02:30 on the day Amsterdam skips 02:00-03:00: it runs at 03:00 local.
        (AMSTERDAM, "daily", dt.time(2, 30), local(AMSTERDAM, 2026, 3, 29, 1, 59, 59), (D(2026, 3, 27), D(2026, 3, 27))),
        (AMSTERDAM, "daily", dt.time(2, 30), local(AMSTERDAM, 2026, 3, 29, 3, 0), (D(2026, 3, 28), D(2026, 3, 28))),
        # Daily at 01:30 on the night New York repeats 01:00-02:00: both 01:30s name the same period.
        (NEW_YORK, "daily", dt.time(1, 30), local(NEW_YORK, 2026, 11, 1, 1, 29), (D(2026, 10, 30), D(2026, 10, 30))),
        (NEW_YORK, "daily", dt.time(1, 30), local(NEW_YORK, 2026, 11, 1, 1, 30, fold=0), (D(2026, 10, 31), D(2026, 10, 31))),
        (NEW_YORK, "daily", dt.time(1, 30), local(NEW_YORK, 2026, 11, 1, 1, 30, fold=1), (D(2026, 10, 31), D(2026, 10, 31))),
        # Weekly (Mondays) at 22:00 in New York: Monday 12 January 2026, already Tuesday in UTC.
        (NEW_YORK, "weekly", dt.time(22), local(NEW_YORK, 2026, 1, 12, 21, 59, 59), (D(2025, 12, 29), D(2026, 1, 4))),
        (NEW_YORK, "weekly", dt.time(22), local(NEW_YORK, 2026, 1, 12, 22, 0), (D(2026, 1, 5), D(2026, 1, 11))),
        (NEW_YORK, "weekly", dt.time(22), local(NEW_YORK, 2026, 1, 14, 10, 0), (D(2026, 1, 5), D(2026, 1, 11))),
        (NEW_YORK, "weekly", dt.time(22), local(NEW_YORK, 2026, 1, 18, 23, 59), (D(2026, 1, 5), D(2026, 1, 11))),
        # Monthly (the 1st) at 01:00 in Amsterdam: still 28 February in UTC; across a year end.
        (AMSTERDAM, "monthly", dt.time(1), local(AMSTERDAM, 2026, 3, 1, 0, 59, 59), (D(2026, 1, 1), D(2026, 1, 31))),
        (AMSTERDAM, "monthly", dt.time(1), local(AMSTERDAM, 2026, 3, 1, 1, 0), (D(2026, 2, 1), D(2026, 2, 28))),
        (AMSTERDAM, "monthly", dt.time(1), local(AMSTERDAM, 2026, 1, 1, 0, 59), (D(2025, 11, 1), D(2025, 11, 30))),
        (AMSTERDAM, "monthly", dt.time(1), local(AMSTERDAM, 2026, 1, 1, 1, 0), (D(2025, 12, 1), D(2025, 12, 31))),
        (AMSTERDAM, "monthly", dt.time(1), local(AMSTERDAM, 2026, 1, 20, 12, 0), (D(2025, 12, 1), D(2025, 12, 31))),
    ],
    ids=lambda v: v.isoformat() if isinstance(v, dt.datetime) else None,
)
def test_schedule_period_around_the_run_time_in_the_accounts_zone(zone, period, at, now, expected):
    assert period_at(zone, period, at, now.astimezone(dt.UTC)) == expected


@pytest.fixture
def nightly(account, owner) -> ExportSchedule:
    return ExportSchedule.objects.create(account=account, requested_by=owner, period=SchedulePeriod.DAILY,
                                         at_time=dt.time(1, 0))


def doorbells() -> list[dict]:
    return [SignedPackage.loads(q.payload)["args"][0] for q in OrmQ.objects.order_by("id")]


def test_a_double_fired_schedule_makes_one_export(account, nightly, django_capture_on_commit_callbacks):
    now = local(AMSTERDAM, 2026, 3, 10, 2, 0)  # UTC account: 01:00 UTC has passed

    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules(now=now) == 1
        assert run_export_schedules(now=now) == 0

    export = ExportRecord.objects.get()
    assert (export.start_date, export.end_date, export.status) == (D(2026, 3, 9), D(2026, 3, 9), ExportStatus.QUEUED)
    assert export.idempotency_key == f"schedule-{nightly.pk}-2026-03-09"
    assert [m["ref"] for m in doorbells()] == [str(export.pk)]  # one doorbell too

    # The next day makes the next export.
    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules(now=now + dt.timedelta(days=1)) == 1
    assert sorted(ExportRecord.objects.values_list("start_date", flat=True)) == [D(2026, 3, 9), D(2026, 3, 10)]


@pytest.mark.django_db(transaction=True)
def test_a_schedule_fired_from_four_threads_at_once_makes_one_export(account, nightly):
    # Threads use their own database connections, so the rows must be committed: transaction=True.
    now = local(AMSTERDAM, 2026, 3, 10, 2, 0)
    start = threading.Barrier(4)
    results, errors = [], []

    def fire():
        try:
            start.wait(timeout=10)
            results.append(run_export_schedules(now=now))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=fire) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)

    assert not errors
    assert sorted(results) == [0, 0, 0, 1]
    assert ExportRecord.objects.count() == 1
    assert len(doorbells()) == 1


def test_east_of_utc_the_export_waits_until_its_utc_day_is_over(account, owner, django_capture_on_commit_callbacks):
    Account.objects.filter(pk=account.pk).update(timezone="Asia/Tokyo")
    schedule = ExportSchedule.objects.create(account=account, requested_by=owner, at_time=dt.time(1, 0))
    run_time = local(TOKYO, 2026, 1, 15, 1, 0)  # 16:00 UTC on the 14th: eight hours of the 14th to come

    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules(now=run_time) == 0
        assert run_export_schedules(now=local(TOKYO, 2026, 1, 15, 8, 59, 59)) == 0
        assert run_export_schedules(now=local(TOKYO, 2026, 1, 15, 9, 0)) == 1  # 00:00 UTC on the 15th

    export = ExportRecord.objects.get()
    assert (export.start_date, export.end_date) == (D(2026, 1, 14), D(2026, 1, 14))
    assert export.idempotency_key == f"schedule-{schedule.pk}-2026-01-14"


def test_west_of_utc_the_export_is_requested_at_the_local_run_time(account, owner, django_capture_on_commit_callbacks):
    Account.objects.filter(pk=account.pk).update(timezone="America/New_York")
    ExportSchedule.objects.create(account=account, requested_by=owner, at_time=dt.time(1, 0))

    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules(now=local(NEW_YORK, 2026, 1, 15, 0, 59)) == 1  # still the 13th's turn
        assert run_export_schedules(now=local(NEW_YORK, 2026, 1, 15, 1, 0)) == 1   # 06:00 UTC: the 14th is over

    assert sorted(ExportRecord.objects.values_list("start_date", flat=True)) == [D(2026, 1, 13), D(2026, 1, 14)]


def test_a_recurring_export_of_an_account_over_budget_waits_in_the_holding_area(
    account, nightly, django_capture_on_commit_callbacks,
):
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=2, max_concurrent=1)
    UsageDay.objects.create(account=account, queue="exports", day=clock.budget_day(), cpu_used_ms=2_500)

    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules() == 1
        assert run_export_schedules() == 0

    export = ExportRecord.objects.get()
    assert export.status == ExportStatus.QUEUED
    held = DeferredTask.objects.get()
    assert (held.job, held.ref, held.account_id, held.queue, held.reason) == (
        "exports.build", str(export.pk), account.pk, "exports", DeferReason.BUDGET_EXHAUSTED)
    assert held.eligible_at == clock.next_reset()
    assert not OrmQ.objects.exists()
    # The default queue's budget is separate: small work of the same account is not held.
    assert enqueue(job="tests.noop", account=account.pk, ref="small") is not None
    assert not DeferredTask.objects.filter(queue="default").exists()


def test_a_refused_schedule_does_not_stop_the_others(account, other_account, owner, outsider, nightly,
                                                      django_capture_on_commit_callbacks):
    globex_nightly = ExportSchedule.objects.create(account=other_account, requested_by=outsider,
                                                   at_time=dt.time(1, 0))
    Membership.objects.filter(user=owner).delete()  # acme's requester lost access

    with django_capture_on_commit_callbacks(execute=True):
        assert run_export_schedules(now=local(AMSTERDAM, 2026, 3, 10, 12, 0)) == 1

    assert list(ExportRecord.objects.values_list("account__slug", "idempotency_key")) == [
        ("globex", f"schedule-{globex_nightly.pk}-2026-03-09")]
