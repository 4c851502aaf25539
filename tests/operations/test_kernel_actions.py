"""Operator actions on the kernel and budgets: pause and resume an account or a queue, release
held work, run a schedule now, adjust a budget for today or for good. Each checks the role,
reports per item and writes Django's admin log."""
import datetime as dt

import pytest
from django.contrib.admin.models import LogEntry
from django_q.models import OrmQ, Schedule

from budgets.adjust import budget_adjust, end_adjustments
from budgets.models import Budget, BudgetAdjustment, Role
from budgets.plans import budgets_ensure_defaults
from scheduling import clock, holding
from scheduling.actions import release_held, run_schedule_now
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause, TaskRun
from scheduling.pausing import UNTIL_RESUMED, pause, resume
from scheduling.runtime import enqueue, execute
from scheduling.schedules import sync_schedules
from tests.factories import MembershipFactory, UserFactory

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("beating_workers")]


def _sent() -> int:
    return OrmQ.objects.count()


def _messages(results) -> list[tuple[bool, str]]:
    return [(r.ok, r.message) for r in results]


def test_a_paused_account_holds_its_work_with_that_reason_until_resumed(account, other_account, operator, viewer):
    assert pause(user=operator, account=account).ok
    assert enqueue(job="tests.noop", account=account.pk, ref="1/a") is None  # held, not sent
    assert enqueue(job="tests.noop", account=other_account.pk, ref="1/b") is not None  # others run
    held = DeferredTask.objects.get(ref="1/a")
    assert (held.reason, held.eligible_at) == (DeferReason.PAUSED, UNTIL_RESUMED)
    assert holding.release_due() == 0  # time never releases paused work

    # Work already on its way when the pause began is held when it starts, and does not run.
    execute(Envelope(job="tests.noop", account=account.pk, ref="1/c").to_message())
    assert TaskRun.objects.get(ref="1/c").outcome == Outcome.DEFERRED
    assert DeferredTask.objects.get(ref="1/c").reason == DeferReason.PAUSED

    assert _messages([resume(user=viewer, account=account)]) == [
        (False, "your role (viewer) may not do this; it needs operator")]
    before = _sent()
    assert _messages([resume(user=operator, account=account)]) == [(True, "resumed; released 2 held task(s)")]
    assert not DeferredTask.objects.exists() and _sent() == before + 2
    assert not Pause.objects.exists()
    assert list(LogEntry.objects.filter(user=operator).order_by("pk").values_list("change_message", flat=True)) == [
        "Paused account acme", "Resumed account acme"]


def test_pausing_twice_or_resuming_what_is_not_paused_says_why(account, operator):
    assert pause(user=operator, account=account).ok
    assert _messages([pause(user=operator, account=account)]) == [(False, "already paused")]
    assert resume(user=operator, account=account).ok
    assert _messages([resume(user=operator, account=account)]) == [(False, "not paused")]


def test_a_paused_queue_holds_every_accounts_work_on_it_and_only_superusers_pause_queues(
        account, other_account, operator, root):
    assert _messages([pause(user=operator, queue="default")]) == [(False, "only a superuser may do this")]
    assert pause(user=root, queue="default").ok
    for acct in (account, other_account):
        assert enqueue(job="tests.noop", account=acct.pk, ref=f"1/{acct.slug}") is None
    assert enqueue(job="tests.hold_exports_worker", account=account.pk, ref="1/exports") is not None  # other queue
    assert set(DeferredTask.objects.values_list("reason", flat=True)) == {DeferReason.PAUSED}

    # An account paused as well stays held when the queue resumes.
    assert pause(user=root, account=account).ok
    assert _messages([resume(user=root, queue="default")]) == [(True, "resumed; released 1 held task(s)")]
    assert list(DeferredTask.objects.values_list("ref", flat=True)) == ["1/acme"]


def test_release_held_work_reports_each_task(account, other_account, operator):
    now = clock.now()
    for acct, ref in ((account, "1/mine"), (other_account, "1/theirs")):
        holding.hold(envelope=Envelope(job="tests.noop", account=acct.pk, ref=ref), queue="default",
                     reason=DeferReason.RETRY_BACKOFF, eligible_at=now + dt.timedelta(hours=1))
    mine, theirs = (DeferredTask.objects.get(ref=r).pk for r in ("1/mine", "1/theirs"))
    before = _sent()
    assert _messages(release_held(user=operator, deferred_ids=[mine, theirs, mine])) == [
        (True, "released to the queue"), (False, "not found"), (False, "not found (already released?)")]
    assert _sent() == before + 1
    assert list(DeferredTask.objects.values_list("ref", flat=True)) == ["1/theirs"]
    assert LogEntry.objects.get(object_id=str(mine)).change_message == "Released from the holding area (was: Waiting to retry)"


def test_run_a_schedule_now_sends_its_job_once_and_only_for_superusers(operator, root):
    sync_schedules()
    schedule = Schedule.objects.get(name="fairshare:purge-expired-exports")
    next_run = schedule.next_run
    assert _messages([run_schedule_now(user=operator, schedule_id=schedule.pk)]) == [
        (False, "only a superuser may do this")]
    before = _sent()
    assert run_schedule_now(user=root, schedule_id=schedule.pk).ok
    assert _sent() == before + 1
    assert Schedule.objects.get(pk=schedule.pk).next_run == next_run  # its timetable is unchanged
    execute(OrmQ.objects.latest("id").task["args"][0])  # what the worker would run
    assert TaskRun.objects.get(ref="schedule:purge-expired-exports").outcome == Outcome.SUCCEEDED
    assert LogEntry.objects.get(object_id=str(schedule.pk)).change_message == "Ran now"

    plain = Schedule.objects.create(name="django-q2's own", func="math.floor", args="(1.5,)")
    assert run_schedule_now(user=root, schedule_id=plain.pk).ok
    assert OrmQ.objects.latest("id").task["func"] == "math.floor"


def test_adjust_a_budget_for_today_only_then_it_goes_back(account, owner, operator, monkeypatch):
    budgets_ensure_defaults(account=account)
    budget = Budget.objects.get(account=account, queue="default")
    original = budget.cpu_seconds_per_day
    assert _messages([budget_adjust(user=operator, budget_id=budget.pk, cpu_seconds_per_day=1, today_only=False)]) == [
        (False, "your role (operator) may not do this; it needs owner")]

    result = budget_adjust(user=owner, budget_id=budget.pk, cpu_seconds_per_day=original * 2, today_only=True)
    assert result.ok and "only" in result.message
    budget_adjust(user=owner, budget_id=budget.pk, cpu_seconds_per_day=original * 3, today_only=True)
    assert Budget.objects.get(pk=budget.pk).cpu_seconds_per_day == original * 3
    assert end_adjustments() == 0  # still today

    tomorrow = clock.now() + dt.timedelta(days=1)
    monkeypatch.setattr("budgets.clock.now", lambda: tomorrow)
    assert end_adjustments() == 1
    assert Budget.objects.get(pk=budget.pk).cpu_seconds_per_day == original  # the day's original, not the 2x
    assert LogEntry.objects.filter(object_id=str(budget.pk), user=owner).count() == 2
    assert BudgetAdjustment.objects.filter(budget=budget).count() == 2  # the history stays


def test_adjust_for_good_replaces_a_pending_today_only_change(account, owner, monkeypatch):
    budgets_ensure_defaults(account=account)
    budget = Budget.objects.get(account=account, queue="default")
    budget_adjust(user=owner, budget_id=budget.pk, cpu_seconds_per_day=5, today_only=True)
    assert budget_adjust(user=owner, budget_id=budget.pk, cpu_seconds_per_day=7, today_only=False).ok
    tomorrow = clock.now() + dt.timedelta(days=1)
    monkeypatch.setattr("budgets.clock.now", lambda: tomorrow)
    assert end_adjustments() == 0
    assert Budget.objects.get(pk=budget.pk).cpu_seconds_per_day == 7
    outsider = MembershipFactory(user=UserFactory(username="x"), role=Role.OWNER).user
    assert _messages([budget_adjust(user=outsider, budget_id=budget.pk, cpu_seconds_per_day=1, today_only=True)]) == [
        (False, "not found")]


def test_pause_and_resume_from_the_command_line(account, operator, capsys):
    from django.core.management import CommandError, call_command

    call_command("pause_work", "--account", "acme", "--user", "acme-operator")
    assert "account acme: paused" in capsys.readouterr().out
    assert enqueue(job="tests.noop", account=account.pk, ref="1/cli") is None
    with pytest.raises(CommandError, match="only a superuser"):
        call_command("pause_work", "--queue", "default", "--user", "acme-operator")
    call_command("pause_work", "--account", "acme", "--resume", "--user", "acme-operator")
    assert "released 1 held task(s)" in capsys.readouterr().out
    assert not DeferredTask.objects.exists()
