"""The outbox: a usage event is written by the statement that charges the ledger, in its
transaction, so it exists exactly when the charge does; its figures add up to the ledger."""
import datetime as dt
import json

import pytest
from django.db import transaction

from budgets import clock, ledger
from budgets.models import Budget, Reservation, UsageDay
from exports.models import ExportStatus
from scheduling import holding
from scheduling.metering import Meter
from scheduling.models import Outcome, TaskRun
from scheduling.services import RunEnd, task_run_mark_lost, task_run_new
from scheduling.envelope import Envelope
from tests.factories import AccountFactory
from usage import relay, replay
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db

QUEUE = "default"


@pytest.fixture
def day():
    return clock.budget_day()


@pytest.fixture
def acme(account):
    Budget.objects.create(account=account, queue=QUEUE, cpu_seconds_per_day=100, max_concurrent=4)
    return account


def slot_running(account, day, ref: str, reserve_ms: int = 1000) -> int:
    run = task_run_new(job="tests.noop", queue=QUEUE, account_id=account.pk, ref=ref)
    with transaction.atomic():
        assert ledger.lock(account_id=account.pk, queue=QUEUE)
        state = ledger.standing(account_id=account.pk, queue=QUEUE, day=day)
        return ledger.activate(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue=QUEUE,
                               state=state, day=day, own=None, reserve_ms=reserve_ms, run=run, worker="w")


def settle(account, slot: int, *, cpu_ms: int, wall_ms: int, outcome=Outcome.SUCCEEDED):
    meter = Meter(cpu_ms=cpu_ms, wall_ms=wall_ms, db_wait_ms=4.4, storage_wait_ms=1.6)
    return ledger.charge(slot_id=slot, account_id=account.pk, queue=QUEUE, meter=meter, cap_hit=False,
                         end=RunEnd(meter=meter, outcome=outcome, items=7), now=holding.clock.now())


def published():
    """The outbox's events as the relay publishes them."""
    return [event for _, event in relay.oldest(batch=100_000)]


def events():
    return [json.loads(event.payload) for event in published()]


def no_difference(day: dt.date) -> list[str]:
    rebuilt = replay.rebuild(events(), first_day=day, last_day=day)
    return replay.differences(rebuilt.totals, replay.ledger(first_day=day, last_day=day))


def test_a_settlement_writes_one_event_with_the_run_and_its_charge(acme, day, usage_on):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = settle(acme, slot_running(acme, day, "a"), cpu_ms=120, wall_ms=300)
    assert slot is not None
    [event] = events()
    run = TaskRun.objects.get(ref="a")
    assert event["v"] == 1 and event["type"] == "run.settled"
    assert (event["account"], event["queue"], event["day"], event["run"], event["job"], event["ref"]) == (
        acme.pk, QUEUE, day.isoformat(), run.pk, "tests.noop", "a")
    assert (event["outcome"], event["cpu_ms"], event["wall_ms"], event["items"]) == ("succeeded", 120, 300, 7)
    assert event["charged"] == {"runs": 1, "cpu_ms": 120, "wall_ms": 300, "db_wait_ms": 4, "storage_wait_ms": 2}
    assert [event.subject for event in published()] == [f"run.{QUEUE}.{acme.pk}"]
    assert no_difference(day) == []


def test_no_customer_data_or_secrets_in_an_event(acme, day, usage_on):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    run_slot = slot_running(acme, day, "b")
    TaskRun.objects.filter(ref="b").update(error_message="SELECT * FROM customers WHERE email='x@example.com'")
    settle(acme, run_slot, cpu_ms=1, wall_ms=1, outcome=Outcome.FAILED)
    [event] = events()
    assert "error" not in " ".join(event) and "example.com" not in str(event)
    assert set(event) == {"v", "id", "type", "at", "account", "queue", "day", "run", "job", "ref", "outcome",
                          "started_at", "finished_at", "cpu_ms", "wall_ms", "db_wait_ms", "storage_wait_ms",
                          "items", "charged"}


def test_a_rolled_back_settlement_leaves_no_event(acme, day, usage_on):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = slot_running(acme, day, "a")
    with pytest.raises(RuntimeError), transaction.atomic():
        settle(acme, slot, cpu_ms=50, wall_ms=60)
        assert UsageEvent.objects.count() == 1  # written with it...
        raise RuntimeError("the settlement's transaction fails")
    assert not UsageEvent.objects.exists()  # ...and gone with it
    assert UsageDay.objects.get(account=acme).cpu_used_ms == 0


def test_no_event_while_the_usage_log_is_off(acme, day):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    settle(acme, slot_running(acme, day, "a"), cpu_ms=50, wall_ms=60)
    assert not UsageEvent.objects.exists()


def test_reclaim_revival_and_late_settlement_add_up_to_the_ledger(acme, day, usage_on):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    # One run dies: reclaimed (charged what it reported), marked lost.
    dead = slot_running(acme, day, "dead")
    with transaction.atomic():
        ledger.reclaim(slot=Reservation.objects.select_for_update().get(pk=dead), charge_ms=400)
        task_run_mark_lost(run_id=TaskRun.objects.get(ref="dead").pk, cpu_ms=400, reason="gone")
    # One was frozen: reclaimed, revived, then settles with more CPU than the reclaim charged.
    frozen = slot_running(acme, day, "frozen")
    with transaction.atomic():
        ledger.reclaim(slot=Reservation.objects.select_for_update().get(pk=frozen), charge_ms=300)
    with transaction.atomic():
        assert ledger.revive(slot_id=frozen, account_id=acme.pk, queue=QUEUE, reserve_ms=1000) == 300
    settle(acme, frozen, cpu_ms=700, wall_ms=900)
    # One was only slow: reclaimed, then settles (its slot reclaimed: counted by the reclaim).
    slow = slot_running(acme, day, "slow")
    with transaction.atomic():
        ledger.reclaim(slot=Reservation.objects.select_for_update().get(pk=slow), charge_ms=100)
    settle(acme, slow, cpu_ms=250, wall_ms=260)

    kinds = [(e["type"], e["ref"], e["outcome"]) for e in events()]
    assert kinds == [("run.settled", "dead", "lost"), ("run.settled", "frozen", "lost"),
                     ("run.revived", "frozen", "running"), ("run.settled", "frozen", "succeeded"),
                     ("run.settled", "slow", "lost"), ("run.settled", "slow", "succeeded")]
    row = UsageDay.objects.get(account=acme)
    assert (row.runs, row.cpu_used_ms) == (3, 400 + 700 + 250)
    assert no_difference(day) == []


def test_an_undone_admission_writes_no_event(acme, day, usage_on):
    UsageDay.objects.create(account=acme, queue=QUEUE, day=day)
    slot = slot_running(acme, day, "ahead")
    assert ledger.unadmit(slot_id=slot, account_id=acme.pk, queue=QUEUE) is not None
    assert not UsageEvent.objects.exists()
    assert no_difference(day) == []


def test_an_exports_end_writes_one_event(owner, account, usage_on):
    from exports.requests import export_request

    export = export_request(account_slug=account.slug, user=owner, start=dt.date(2026, 1, 1),
                            end=dt.date(2026, 1, 2), enqueue=False)[0]
    type(export).objects.filter(pk=export.pk).update(status=ExportStatus.RUNNING)
    assert not UsageEvent.objects.exists()
    type(export).objects.filter(pk=export.pk).update(status=ExportStatus.SUCCEEDED, row_count=12, byte_size=345)
    [event] = events()
    assert (event["type"], event["export"], event["status"], event["rows"], event["bytes"]) == (
        "export.finished", str(export.pk), "succeeded", 12, 345)
    assert [event.subject for event in published()] == [f"export.{account.pk}"]


def test_other_accounts_days_are_kept_apart(acme, day, usage_on):
    other = AccountFactory()
    Budget.objects.create(account=other, queue=QUEUE, cpu_seconds_per_day=100, max_concurrent=4)
    for account in (acme, other):
        UsageDay.objects.create(account=account, queue=QUEUE, day=day)
        settle(account, slot_running(account, day, f"r{account.pk}"), cpu_ms=10 * account.pk, wall_ms=5)
    rebuilt = replay.rebuild(events(), first_day=day, last_day=day, account=other.pk)
    assert list(rebuilt.totals) == [(other.pk, QUEUE, day)]
    assert rebuilt.totals[(other.pk, QUEUE, day)].cpu_used_ms == 10 * other.pk


def test_the_replay_refuses_an_event_of_a_version_it_does_not_know(day):
    event = {"v": 2, "id": "x", "type": "run.settled", "day": day.isoformat(), "account": 1, "queue": QUEUE,
             "charged": {"runs": 1}}
    with pytest.raises(replay.UnknownVersion, match="version 2"):
        replay.rebuild([event], first_day=day, last_day=day)


def test_a_read_from_a_sequence_rebuilds_from_the_day_after_its_first_event(day):
    def event(n: int, on: dt.date) -> dict:
        return {"v": 1, "id": f"e{n}", "type": "run.settled", "day": on.isoformat(), "account": 1, "queue": QUEUE,
                "charged": {"runs": 1, "cpu_ms": 10}}
    tomorrow = day + dt.timedelta(days=1)
    rebuilt = replay.rebuild([event(1, day), event(2, day), event(3, tomorrow)], first_day=None, last_day=tomorrow)
    assert rebuilt.first_day == tomorrow  # the first day may have begun before the sequence: not whole
    assert list(rebuilt.totals) == [(1, QUEUE, tomorrow)] and rebuilt.totals[(1, QUEUE, tomorrow)].runs == 1


def test_the_relay_and_the_replay_say_the_log_is_off_without_a_nats_url(settings):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    settings.FAIRSHARE = {**settings.FAIRSHARE, "USAGE_NATS_URL": ""}
    with pytest.raises(CommandError, match="FAIRSHARE_USAGE_NATS_URL is not set"):
        call_command("usage_relay", "--once")
    with pytest.raises(CommandError, match="FAIRSHARE_USAGE_NATS_URL is not set"):
        call_command("usage_replay", "--since", "2026-12-01", "--check")
