"""Tiered fair share in-process: rate limits (at most N starts per period per account and queue),
weights (the fair order between accounts) and a job's default priority (the order within one
account's line). With real workers: test_rates_and_weights_processes.py."""
import datetime as dt

import pytest
from django.utils import timezone

from budgets.admission import admit
from budgets.handoff import fetch_next
from budgets.models import Budget, Reservation, ReservationStatus
from budgets.settlement import settle
from scheduling import clock
from scheduling.envelope import Envelope
from scheduling.gates import Wait
from scheduling.holding import release_due, unblock  # release_due: the pulse's tick
from scheduling.models import Backlog, DeferReason, DeferredTask, TaskRun
from scheduling.runtime import enqueue, enqueue_many
from scheduling.services import task_run_new
from scheduling.waits import why_held
from tests.budgets.test_admission import meter
from tests.factories import AccountFactory

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def budget(account, *, cap: int = 10, weight: int = 1, rate: tuple[int, int] | None = None) -> Budget:
    starts, period = rate or (None, 60)
    return Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=cap,
                                 weight=weight, rate_starts=starts, rate_period_s=period)


def start(account, ref: str):
    """A run of the job starts as a worker starts it: admitted with its run recorded."""
    return admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", estimate_ms=10,
                 worker="w", run=task_run_new(job="tests.noop", queue="default", account_id=account.pk, ref=ref))


def held_from_the_start(*accounts, jobs: int) -> None:
    """Each account's `jobs` all held in its line, none sent, in the accounts' order: enqueued while
    its budget is spent, then given budget again and its line let go."""
    for account in accounts:
        Budget.objects.filter(account=account).update(cpu_seconds_per_day=0)
        enqueue_many(job="tests.noop", work=[(account.pk, f"0/{account.slug}-{i}") for i in range(jobs)])
        Budget.objects.filter(account=account).update(cpu_seconds_per_day=100)
        unblock(account_id=account.pk, queue="default")


def a_window_later(settings, period_s: int) -> None:
    """Move the recorded starts out of their window (TaskRun's wall clock) and the kernel's clock past
    the held line's block."""
    TaskRun.objects.update(started_at=timezone.now() - dt.timedelta(seconds=period_s + 1))
    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": period_s + 1}


def test_an_account_at_its_rate_limit_waits_with_its_reason_and_eta_and_goes_when_the_window_moves(
        account, settings):
    budget(account, rate=(3, 60))
    sent = [enqueue(job="tests.noop", account=account.pk, ref=f"0/{i}") for i in range(5)]
    # Three go (a job on its way counts as a start), two wait: its slots are free, its rate is not.
    assert [s is not None for s in sent] == [True, True, True, False, False]
    assert DeferredTask.objects.get(ref="0/3").reason == DeferReason.RATE_LIMITED
    assert DeferredTask.objects.get(ref="0/4").reason == DeferReason.RATE_LIMITED  # the cause, before its line

    runs = [start(account, f"0/{i}") for i in range(3)]
    first_start = TaskRun.objects.order_by("started_at").first().started_at
    settled = settle(slot_id=runs[0].slot_id, account_id=account.pk, queue="default", meter=meter(5), hand_to="w")

    # Its slot is free, but three started in the window: nothing is handed off, and the line waits
    # until the first start leaves the window, which every job of the line is shown.
    assert settled.handed_to is None
    line = Backlog.objects.get(account=account)
    expected = clock.from_wall(first_start + dt.timedelta(seconds=60))
    assert abs((line.blocked_until - expected).total_seconds()) < 0.01
    assert line.blocked_reason == DeferReason.RATE_LIMITED
    held = list(DeferredTask.objects.all())  # what each is shown: its line's cause and time, not a copy
    assert set(why_held(held).values()) == {Wait(DeferReason.RATE_LIMITED, line.blocked_until)}
    assert fetch_next(queue="default", worker="w2") is None
    assert release_due() == 0

    a_window_later(settings, 60)
    assert release_due() == 2  # the two held jobs, into two of its three starts
    assert not DeferredTask.objects.exists()


def test_a_start_past_the_rate_limit_is_refused_even_with_free_slots(account):
    budget(account, rate=(1, 30))
    assert start(account, "0/a").admitted
    refused = start(account, "0/b")  # a duplicate delivery, an operator's release: no slot of its own

    assert not refused.admitted and refused.reason == DeferReason.RATE_LIMITED
    started = clock.from_wall(TaskRun.objects.get(ref="0/a").started_at)
    assert abs((refused.eligible_at - started - dt.timedelta(seconds=30)).total_seconds()) < 0.01
    assert DeferredTask.objects.get(ref="0/b").reason == DeferReason.RATE_LIMITED


def test_cap_budget_and_rate_compose_the_first_that_refuses_says_why(account):
    budget(account, cap=1, rate=(5, 60))
    assert start(account, "0/a").admitted
    assert start(account, "0/b").reason == DeferReason.CONCURRENCY_CAP  # the cap first
    Budget.objects.filter(account=account).update(max_concurrent=5, cpu_seconds_per_day=0)
    assert start(account, "0/c").reason == DeferReason.BUDGET_EXHAUSTED  # then the budget
    Budget.objects.filter(account=account).update(cpu_seconds_per_day=100, rate_starts=1)
    assert start(account, "0/d").reason == DeferReason.RATE_LIMITED  # then the rate


def test_a_batch_sends_what_its_rate_limit_lets_start_and_holds_the_rest_in_order(account):
    budget(account, rate=(3, 60))
    sent = enqueue_many(job="tests.noop", work=[(account.pk, f"0/{i}") for i in range(6)])

    assert [s is not None for s in sent] == [True] * 3 + [False] * 3
    assert list(DeferredTask.objects.order_by("in_line_since", "id").values_list("reason", flat=True)) == [
        DeferReason.RATE_LIMITED, DeferReason.QUEUED_BEHIND, DeferReason.QUEUED_BEHIND]


def test_a_rate_limited_account_leaves_its_workers_to_the_others_work(account, other_account):
    """Work conservation: an account at its rate limit is not pulled; another account's is."""
    budget(account, rate=(1, 60))
    budget(other_account)
    assert start(account, "0/a").admitted
    enqueue_many(job="tests.noop", work=[(account.pk, "0/b")])  # held: rate limited
    enqueue_many(job="tests.noop", work=[(other_account.pk, f"0/o{i}") for i in range(12)])  # 2 held past its cap
    Reservation.objects.filter(account=other_account, ref__in=["0/o0", "0/o1"]).delete()  # two of its runs ended

    pulled = fetch_next(queue="default", worker="w2")
    assert pulled is not None and pulled.envelope.account == other_account.pk
    assert DeferredTask.objects.get(ref="0/b").claimed_by == ""


def test_pull_shares_the_workers_by_weight():
    light, heavy = AccountFactory(slug="light"), AccountFactory(slug="heavy")
    budget(light, weight=1)
    budget(heavy, weight=3)
    held_from_the_start(light, heavy, jobs=10)  # light's line first

    order = [fetch_next(queue="default", worker=f"w{i}").envelope.account for i in range(8)]

    # Fewest slots for their weight first (ties: the longest waiting): 1:3.
    assert order == [light.pk, heavy.pk, heavy.pk, heavy.pk, light.pk, heavy.pk, heavy.pk, heavy.pk]


def test_a_settlement_leaves_its_slot_to_the_fair_order_when_another_accounts_turn_comes_first(
        account, other_account):
    budget(account, cap=2)
    budget(other_account, cap=1)
    enqueue_many(job="tests.noop", work=[(other_account.pk, f"0/o{i}") for i in range(2)])  # o1 held
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/a{i}") for i in range(3)])  # a2 held, later
    first, _ = start(account, "0/a0"), start(account, "0/a1")
    Reservation.objects.filter(account=other_account).delete()  # o0 ran: the other account uses no slot

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5), hand_to="w")

    # Its account keeps one slot, the other has none: not to its own next job, the worker pulls.
    assert settled.handed_to is None and settled.waiting
    assert fetch_next(queue="default", worker="w").envelope.ref == "0/o1"


def test_a_settlement_keeps_its_slot_on_a_tie(account, other_account):
    budget(account, cap=1)
    budget(other_account, cap=1)
    enqueue_many(job="tests.noop", work=[(other_account.pk, f"0/o{i}") for i in range(2)])
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/a{i}") for i in range(2)])
    first = start(account, "0/a0")
    Reservation.objects.filter(account=other_account).delete()

    settled = settle(slot_id=first.slot_id, account_id=account.pk, queue="default", meter=meter(5), hand_to="w")

    assert settled.handed_to.envelope.ref == "0/a1"  # both use no slot then: the cheap way, its own next


def test_the_pulse_of_an_idle_worker_releases_one_job_in_fair_order(account, other_account):
    budget(account, cap=3)
    budget(other_account, cap=3)
    held_from_the_start(account, other_account, jobs=3)

    assert release_due(idle_workers={"default": 0}) == 0  # a busy worker's pulse sends nothing
    assert release_due(idle_workers={"default": 1}) == 1  # an idle one's, one job
    assert list(Reservation.objects.values_list("ref", flat=True)) == [f"0/{account.slug}-0"]  # the longest waiting
    assert release_due() == 5  # the schedule's: every line into its free slots
    assert Reservation.objects.filter(status=ReservationStatus.DISPATCHED).count() == 6
    assert not DeferredTask.objects.exists()


def test_a_jobs_default_priority_orders_its_accounts_line(account):
    budget(account, cap=1)
    enqueue(job="tests.noop", account=account.pk, ref="0/running")
    enqueue_many(job="tests.noop", work=[(account.pk, f"0/low-{i}") for i in range(3)])
    enqueue(job="tests.noop_urgent", account=account.pk, ref="0/urgent")
    enqueue(job="tests.noop_urgent", account=account.pk, ref="0/overridden", priority=-10)
    run = start(account, "0/running")

    settled = settle(slot_id=run.slot_id, account_id=account.pk, queue="default", meter=meter(5), hand_to="w")

    assert settled.handed_to.envelope.ref == "0/urgent"
    assert DeferredTask.objects.get(ref="0/overridden").priority == -10
