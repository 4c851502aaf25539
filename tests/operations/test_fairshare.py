"""Fair share now (/admin/fairshare/): per account and queue, its share of the workers over the last
5 and 15 minutes, running / sent against its cap, held work by reason and the oldest wait, today's
CPU against its budget; top-N by use with a search; scoped to the user's accounts like every
other page; the operator actions one click away."""
import datetime as dt

import pytest
from django.contrib.admin.models import LogEntry
from django.urls import reverse
from django.utils import timezone

from budgets import clock as budget_clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.plans import budgets_ensure_defaults
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause, TaskRun, WorkerHeartbeat
from tests.factories import AccountFactory

pytestmark = pytest.mark.django_db

TABLE = reverse("ops-fairshare-table")


def _run(account, *, minutes_ago: float, seconds: float | None, queue: str = "default") -> None:
    """A run that started `minutes_ago` and took `seconds` (None: still running)."""
    started = timezone.now() - dt.timedelta(minutes=minutes_ago)
    TaskRun.objects.create(
        account=account, job="tests.noop", queue=queue, started_at=started,
        finished_at=None if seconds is None else started + dt.timedelta(seconds=seconds),
        outcome=Outcome.RUNNING if seconds is None else Outcome.SUCCEEDED, wall_ms=int((seconds or 0) * 1000))


def _hold(account, ref: str, reason: str, *, minutes_ago: float = 0, queue: str = "default") -> None:
    held = DeferredTask.objects.create(account=account, queue=queue, job="tests.noop", ref=ref, reason=reason,
                                       eligible_at=timezone.now(), in_line_since=timezone.now())
    DeferredTask.objects.filter(pk=held.pk).update(created_at=timezone.now() - dt.timedelta(minutes=minutes_ago))


def _slot(account, ref: str, status: str, queue: str = "default") -> None:
    Reservation.objects.create(account=account, queue=queue, day=budget_clock.budget_day(), job="tests.noop", ref=ref,
                               status=status, lease_expires_at=timezone.now() + dt.timedelta(minutes=5))


def _workers(n: int, queue: str = "default") -> None:
    WorkerHeartbeat.objects.bulk_create([WorkerHeartbeat(worker=f"host:{i}", queue=queue, seen_at=timezone.now())
                                         for i in range(n)])


@pytest.fixture
def busy_platform(account):
    """acme floods: two runs of 60 s in the last 5 minutes and one still running for 2 minutes,
    one running and one sent slot, 30 jobs held at its cap, the oldest 7 minutes; globex: one run of
    90 s that started 10 minutes ago and a job waiting to retry; initech: idle but spent CPU today;
    umbrella: nothing at all. Two live workers on the default queue."""
    globex, initech, umbrella = (AccountFactory(slug=s) for s in ("globex", "initech", "umbrella"))
    for a in (account, globex, initech, umbrella):
        budgets_ensure_defaults(account=a)
    _run(account, minutes_ago=4, seconds=60)
    _run(account, minutes_ago=3, seconds=60)
    _run(account, minutes_ago=2, seconds=None)
    _slot(account, "run", ReservationStatus.ACTIVE)
    _slot(account, "sent", ReservationStatus.DISPATCHED)
    for i in range(30):
        _hold(account, f"flood-{i}", DeferReason.CONCURRENCY_CAP if i else DeferReason.QUEUED_BEHIND,
              minutes_ago=7 if i == 0 else 1)
    _run(globex, minutes_ago=10, seconds=90)
    _hold(globex, "retry", DeferReason.RETRY_BACKOFF, minutes_ago=2)
    UsageDay.objects.create(account=initech, queue="default", day=budget_clock.budget_day(), cpu_used_ms=42_000)
    _workers(2)
    return {"acme": account, "globex": globex, "initech": initech, "umbrella": umbrella}


def test_the_table_says_who_uses_the_workers_and_who_waits_why_and_how_long(client, root, busy_platform):
    client.force_login(root)
    rows = client.get(TABLE, {"format": "json"}).json()["rows"]
    assert [(r["account"], r["queue"]) for r in rows] == [("acme", "default"), ("globex", "default"),
                                                           ("initech", "default")]
    acme, globex, initech = rows
    # acme: 60 + 60 + about 120 s of the default queue's 2 workers x 300 s; 15 min the same.
    assert 239 <= acme["worker_s"]["5m"] <= 242 and acme["worker_s"]["15m"] == acme["worker_s"]["5m"]
    assert 0.39 <= acme["share"]["5m"] <= 0.41 and acme["live_workers"] == 2
    assert (acme["running"], acme["sent"], acme["max_concurrent"], acme["held"]) == (1, 1, 2, 30)
    # Its line waits for what holds it now (running and sent fill its cap), whatever each job was held for.
    assert acme["held_by_reason"] == {"Account at its concurrency cap": 30}
    assert 419 <= acme["oldest_wait_s"] <= 425 and acme["oldest_reason"] == "Account at its concurrency cap"
    assert acme["line_waits_for"] == {"reason": "Account at its concurrency cap", "until": None}
    # globex ran 90 s, 10 minutes ago: none of it in the last 5 minutes.
    assert globex["worker_s"] == {"5m": 0.0, "15m": 90.0} and globex["held"] == 1
    # Its retry's back-off is over (it is in line) and nothing holds globex back: it waits for a worker.
    assert globex["held_by_reason"] == {"Waiting for a free worker": 1}
    # initech did not run in the last 15 minutes and holds nothing, but spent CPU today.
    assert initech["worker_s"]["15m"] == 0 and initech["cpu_used_s"] == 42.0 and initech["cpu_limit_s"] == 3600
    page = client.get(reverse("ops-fairshare")).content.decode()
    assert "Fair share now" in page and 'data-account="acme"' in page and "umbrella" not in page
    assert 'id="live" data-refresh-s="5"' in page


def test_the_table_shows_each_accounts_weight_and_how_close_it_is_to_its_rate_limit(client, root):
    free, paying = AccountFactory(slug="freebie", plan="free"), AccountFactory(slug="paying", plan="enterprise")
    for account in (free, paying):
        budgets_ensure_defaults(account=account)
        _hold(account, f"waiting-{account.slug}", DeferReason.CONCURRENCY_CAP)
    for i in range(3):  # three starts in the free plan's window (600 a minute on default)
        TaskRun.objects.create(account=free, queue="default", job="tests.noop", ref=f"r{i}", started_at=timezone.now(),
                               outcome=Outcome.SUCCEEDED)
    client.force_login(root)

    rows = {r["account"]: r for r in client.get(TABLE, {"format": "json"}).json()["rows"]}

    assert rows["freebie"]["weight"] == 1
    assert rows["freebie"]["rate_limit"] == {"starts": 600, "period_s": 60, "recent_starts": 3, "reached": False}
    assert rows["paying"]["weight"] == 4 and rows["paying"]["rate_limit"] is None
    page = client.get(reverse("ops-fairshare")).content.decode()
    assert "3/600 per 60 s" in page


def test_a_run_that_started_before_the_window_counts_only_its_part_in_it(client, root, account):
    budgets_ensure_defaults(account=account)
    _run(account, minutes_ago=20, seconds=16 * 60)  # ended 4 minutes ago: 1 of its minutes in the last 5, 11 in 15
    _run(account, minutes_ago=30, seconds=None)  # still running: the whole 15 minutes
    _workers(1)
    client.force_login(root)
    [row] = client.get(TABLE, {"format": "json"}).json()["rows"]
    assert row["worker_s"]["5m"] == pytest.approx(60 + 300, abs=2) and row["worker_s"]["15m"] == pytest.approx(
        660 + 900, abs=2)
    assert row["share"]["15m"] == 1.0  # more than the one worker: a lost run not reclaimed yet, say


def test_the_top_accounts_are_those_using_the_workers_then_holding_work_then_spending_cpu(client, root):
    """With five shown of twelve: two that ran, two that hold work, one that spent CPU."""
    accounts = [AccountFactory(slug=f"t{i:02}") for i in range(12)]
    for a in accounts:
        Budget.objects.create(account=a, queue="default", cpu_seconds_per_day=600, max_concurrent=1)
    _run(accounts[3], minutes_ago=1, seconds=10)
    _run(accounts[7], minutes_ago=1, seconds=20)
    for i in range(3):
        _hold(accounts[5], f"a{i}", DeferReason.CONCURRENCY_CAP)
    _hold(accounts[9], "b", DeferReason.CONCURRENCY_CAP)
    _hold(accounts[9], "c", DeferReason.CONCURRENCY_CAP)
    for i, ms in ((1, 500), (2, 900), (11, 100)):
        UsageDay.objects.create(account=accounts[i], queue="default", day=budget_clock.budget_day(), cpu_used_ms=ms)
    client.force_login(root)
    rows = client.get(TABLE, {"format": "json", "top": 5}).json()["rows"]
    assert [r["account"] for r in rows] == ["t07", "t03", "t05", "t09", "t02"]


def test_the_search_finds_an_idle_account_by_slug_or_name(client, root, busy_platform):
    client.force_login(root)
    rows = client.get(TABLE, {"format": "json", "q": "umbr"}).json()["rows"]
    assert [(r["account"], r["queue"]) for r in rows] == [("umbrella", "default"), ("umbrella", "exports")]
    assert rows[0]["worker_s"]["15m"] == 0 and rows[0]["held"] == 0
    by_name = client.get(TABLE, {"format": "json", "q": "Glob"}).json()["rows"]
    assert [r["account"] for r in by_name] == ["globex", "globex"]  # its busy queue first
    assert by_name[0]["worker_s"]["15m"] == 90.0
    page = client.get(reverse("ops-fairshare"), {"q": "nobody-here"}).content.decode()
    assert "No account matches" in page


def test_a_tenant_sees_and_finds_only_its_own_accounts(client, operator, busy_platform):
    client.force_login(operator)
    rows = client.get(TABLE, {"format": "json"}).json()["rows"]
    assert {r["account"] for r in rows} == {"acme"}
    assert client.get(TABLE, {"format": "json", "q": "globex"}).json()["rows"] == []
    assert client.get(TABLE, {"format": "json", "q": "Umbrella"}).json()["rows"] == []
    page = client.get(reverse("ops-fairshare")).content.decode()
    for other in ("globex", "initech", "umbrella"):
        assert other not in page
    # The share is of the queue's workers: it says nothing of the other accounts.
    assert 0.39 <= rows[0]["share"]["5m"] <= 0.41
    client.logout()
    assert client.get(TABLE).status_code == 302 and client.get(reverse("ops-fairshare")).status_code == 302


def test_pause_resume_and_adjust_are_one_click_from_the_table(client, root, busy_platform):
    acme = busy_platform["acme"]
    client.force_login(root)
    table = client.get(TABLE).content.decode()
    budget = Budget.objects.get(account=acme, queue="default")
    assert f'<input type="hidden" name="_selected_action" value="{acme.pk}"><button type="submit">pause</button>' in table
    assert f'name="_selected_action" value="{budget.pk}"><button type="submit">adjust budget</button>' in table
    assert f"?account__id__exact={acme.pk}&amp;queue__exact=default" in table
    # What the pause button posts pauses the account and is logged.
    response = client.post(reverse("admin:budgets_account_changelist"),
                           {"action": "pause_accounts", "index": 0, "_selected_action": acme.pk}, follow=True)
    assert "account acme: paused" in response.content.decode().lower()
    assert LogEntry.objects.filter(user=root, change_message="Paused account acme").exists()
    row = client.get(TABLE, {"format": "json", "q": "acme"}).json()["rows"][0]
    assert row["paused"] is True
    assert ('value="resume_accounts"' in client.get(TABLE, {"q": "acme"}).content.decode())
    # The adjust button opens the adjust form for that budget.
    form = client.post(reverse("admin:budgets_budget_changelist"),
                       {"action": "adjust", "index": 0, "_selected_action": budget.pk})
    assert b"CPU seconds per day" in form.content and Pause.objects.filter(account=acme).exists()


def test_the_table_reads_as_many_queries_for_ten_thousand_accounts_as_for_ten(client, root):
    from tests.operations.test_console import _queries, _tenants

    client.force_login(root)
    _tenants(0, 10)
    few = [_queries(client, url) for url in (reverse("ops-fairshare"), TABLE, TABLE + "?q=t9")]
    _tenants(10, 9990)
    many = [_queries(client, url) for url in (reverse("ops-fairshare"), TABLE, TABLE + "?q=t9")]
    assert many == few
    rows = client.get(TABLE, {"format": "json"}).json()["rows"]
    assert len(rows) == 25 and all(r["held"] == 1 for r in rows)
