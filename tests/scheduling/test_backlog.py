"""Backlog, the holding area counted per account and queue, is kept by database triggers in the
statement that changes the holding area: whatever writes it (a hold, a batch of holds, a claim,
lining up, a release, a cancellation, an account deleted), the counts are the rows."""
import datetime as dt

import pytest
from django.db import connection, transaction
from django.db.models import Count, Q

from budgets.models import Account, UsageDay
from budgets import clock as budget_clock
from budgets import ledger
from scheduling import clock, holding
from scheduling.envelope import Envelope
from scheduling.models import Backlog, DeferReason, DeferredTask

pytestmark = pytest.mark.django_db


def counted() -> dict:
    """Each account's and queue's Backlog counts (rows that count nothing left out)."""
    fields = ["held", "in_line", *DeferReason.values]
    return {(b["account_id"], b["queue"]): b for b in Backlog.objects.values("account_id", "queue", *fields)
            if b["held"]}


def recounted() -> dict:
    """The same counts, counted from the held rows themselves (by reason: those out of their line)."""
    rows = (DeferredTask.objects.filter(account__isnull=False).values("account_id", "queue")
            .annotate(held=Count("pk"), in_line=Count("pk", filter=Q(in_line_since__isnull=False)),
                      **{reason: Count("pk", filter=Q(reason=reason, in_line_since__isnull=True))
                         for reason in DeferReason.values}))
    return {(r["account_id"], r["queue"]): r for r in rows}


def test_every_reason_has_its_count():
    assert set(DeferReason.values) <= {field.name for field in Backlog._meta.get_fields()}


def test_the_counts_follow_every_change_of_the_holding_area(account, other_account):
    now = clock.now()

    def job(acct, ref, priority=0):
        return Envelope(job="tests.noop", account=acct.pk, ref=ref, priority=priority)

    holding.hold_many(envelopes=[job(account, f"a{i}") for i in range(3000)], queue="default",
                      reason=DeferReason.QUEUED_BEHIND, eligible_at=now)  # one statement
    holding.hold(envelope=job(account, "later"), queue="default", reason=DeferReason.RETRY_BACKOFF,
                 eligible_at=now + dt.timedelta(minutes=5))
    holding.hold(envelope=job(other_account, "b0"), queue="exports", reason=DeferReason.CONCURRENCY_CAP,
                 eligible_at=now)
    holding.hold(envelope=job(account, "a0"), queue="default", reason=DeferReason.PAUSED,
                 eligible_at=now + dt.timedelta(days=1))  # held again: out of the line, another reason
    holding.hold_scheduled(envelope=Envelope(job="tests.noop", account=None, ref="system"), queue="default",
                           run_after=now + dt.timedelta(minutes=1))  # account-less: counted nowhere
    assert counted() == recounted()
    assert counted()[(account.pk, "default")]["in_line"] == 2999

    day = budget_clock.budget_day()
    usage_id = UsageDay.objects.get_or_create(account=account, queue="default", day=day)[0].pk
    claimed = ledger.claim_for(account_id=account.pk, queue="default", day=day, worker="w", yield_to_broker=False,
                               usage=usage_id, reserve_ms=0)  # a claim changes no count
    assert (claimed.envelope.job, claimed.envelope.ref) == ("tests.noop", "a1")
    assert DeferredTask.objects.filter(ref="a1", claimed_by="w").delete()[0] == 1  # its run started
    with transaction.atomic():
        assert len(ledger.release(account_id=account.pk, queue="default", day=day, limit=10)) == 10
    holding.unhold(job="tests.noop", ref="a20")
    assert counted()[(account.pk, "default")]["retry_backoff"] == 1  # "later" waits for its own time
    in_line = counted()[(account.pk, "default")]["in_line"]
    holding.line_up_due(now + dt.timedelta(minutes=10))  # "later" joins the line, "system" is sent
    assert counted() == recounted()
    # In line it waits for what its line waits for (scheduling.waits), no longer counted by its reason.
    assert counted()[(account.pk, "default")]["retry_backoff"] == 0
    assert counted()[(account.pk, "default")]["in_line"] == in_line + 1
    assert DeferredTask.objects.get(ref="later").in_line_since is not None

    Account.objects.filter(pk=other_account.pk).delete()
    DeferredTask.objects.filter(account=account, ref__startswith="a1").delete()  # one statement, many rows
    assert counted() == recounted()


def test_a_held_up_line_goes_at_the_first_tick_after_its_time(account, other_account):
    """`block` holds a line up until a time; "could it go now" asks no time (so that its prepared
    statements' generic plans read only the lines that could go): the pulse's tick after that time
    lets it go (`unblock_due`), and an operator's `unblock` at once. Lines whose time has not come
    stay held up."""
    now = clock.now()
    for who in (account, other_account):
        holding.hold(envelope=Envelope(job="tests.noop", account=who.pk, ref=f"r-{who.pk}"), queue="default",
                     reason=DeferReason.CONCURRENCY_CAP, eligible_at=now)
    holding.block(account_id=account.pk, queue="default", until=now + dt.timedelta(seconds=1))
    holding.block(account_id=other_account.pk, queue="default", until=now + dt.timedelta(hours=1))

    def ready() -> set[int]:
        return set(Backlog.objects.filter(holding.ready()).values_list("account_id", flat=True))

    def any_ready() -> bool:
        with connection.cursor() as cursor:
            cursor.execute("SELECT waiting FROM fairshare_any_ready(%(queue)s)", {"queue": "default"})
            return cursor.fetchone()[0]

    assert ready() == set() and not any_ready()
    assert holding.unblock_due(now) == 0  # neither time has come
    assert holding.unblock_due(now + dt.timedelta(seconds=2)) == 1
    assert ready() == {account.pk} and any_ready()
    assert holding.unblock(account_id=other_account.pk, queue="default") == 1
    assert ready() == {account.pk, other_account.pk}


def test_the_pulse_ticks_when_the_first_held_up_line_may_go_if_that_is_sooner(account, other_account, monkeypatch):
    from scheduling.pulse import MIN_TICK_S, _until_next_tick

    # The project's clock stands still at `now`: what the pulse waits is exact, however long this
    # test takes on a loaded machine.
    now = clock.now()
    monkeypatch.setattr(clock, "now", lambda: now)
    assert _until_next_tick(1.0) == 1.0  # nothing held up
    holding.hold(envelope=Envelope(job="tests.noop", account=account.pk, ref="r"), queue="default",
                 reason=DeferReason.CONCURRENCY_CAP, eligible_at=now)
    holding.block(account_id=other_account.pk, queue="default", until=now + dt.timedelta(hours=1))
    assert _until_next_tick(1.0) == 1.0  # held up for longer than a tick
    holding.block(account_id=account.pk, queue="default", until=now + dt.timedelta(seconds=0.3))
    assert _until_next_tick(1.0) == 0.3  # a rate limit's window frees within the second
    holding.block(account_id=account.pk, queue="default", until=now + dt.timedelta(seconds=2))
    Backlog.objects.filter(account=account).update(blocked_until=now - dt.timedelta(seconds=1))
    assert _until_next_tick(1.0) == MIN_TICK_S  # its time came: the tick lets it go at once


def test_a_hold_up_set_in_this_process_ends_the_pulses_doze_by_its_time(account):
    """The pulse dozes until its next tick or until a line held up here may go, if sooner."""
    import time

    holding.hold(envelope=Envelope(job="tests.noop", account=account.pk, ref="r"), queue="default",
                 reason=DeferReason.CONCURRENCY_CAP, eligible_at=clock.now())
    holding.block(account_id=account.pk, queue="default", until=clock.now() + dt.timedelta(seconds=0.2))
    start = time.monotonic()
    clock.doze(30)  # 30 s without the alarm
    assert time.monotonic() - start < 10
    start = time.monotonic()
    clock.doze(0.3)  # the alarm came and went: it rings once, this doze sleeps its whole time
    assert time.monotonic() - start >= 0.29
