"""The operator console's pages: actions from the admin, the views operators expect, and the
operations dashboard, whose queries stay bounded whatever the history holds."""
import datetime as dt
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.auth.models import Permission
from django.urls import reverse
from django.utils import timezone
from django_q.models import Schedule

from budgets.models import Budget, UsageDay
from budgets.plans import budgets_ensure_defaults
from exports.models import ExportRecord, ExportStatus
from scheduling.models import DeferReason, DeferredTask, Outcome, Pause, TaskRun, TaskRunDaily
from scheduling.schedules import sync_schedules
from tests.factories import AccountFactory

pytestmark = pytest.mark.django_db


def _history(account, days: int) -> None:
    """`days` days of daily roll-ups and ledger rows, and a day of task runs."""
    today = timezone.now().date()
    TaskRunDaily.objects.bulk_create([
        TaskRunDaily(day=today - dt.timedelta(days=i), account=account, job="exports.build", queue="exports",
                     outcome=outcome, runs=10, cpu_ms=1000)
        for i in range(1, days + 1) for outcome in (Outcome.SUCCEEDED, Outcome.FAILED)])
    UsageDay.objects.bulk_create([UsageDay(account=account, queue=q, day=today - dt.timedelta(days=i), cpu_used_ms=5000)
                                  for i in range(days) for q in ("default", "exports")])
    now = timezone.now()
    TaskRun.objects.bulk_create([TaskRun(account=account, job="tests.noop", started_at=now - dt.timedelta(minutes=5 * i),
                                         outcome=Outcome.FAILED if i % 5 == 0 else Outcome.SUCCEEDED)
                                 for i in range(200)])


@pytest.mark.parametrize("days", [1, 365])
def test_the_dashboard_reads_a_bounded_number_of_queries_whatever_the_history(
        client, root, account, days, django_assert_max_num_queries):
    for n in range(3):
        acct = account if n == 0 else AccountFactory(slug=f"tenant-{n}")
        budgets_ensure_defaults(account=acct)
        _history(acct, days)
    DeferredTask.objects.create(account=account, queue="exports", job="exports.build", ref="x",
                                reason=DeferReason.PAUSED, eligible_at=timezone.now())
    client.force_login(root)
    # A fixed number, whatever the history: held work by what it waits for now reads the lines
    # held up (one aggregate) and those that are not (scheduling.waits.held_counts) besides the counts.
    with django_assert_max_num_queries(20):
        page = client.get(reverse("ops-dashboard"))
    assert page.status_code == 200
    body = page.content.decode()
    for section in ("Queues: depth and oldest job", "Throughput, since ", "(the first run of the last 24 h), per 30 min",
                    "Held work by reason", "CPU used against budget per account and queue"):
        assert section in body
    assert "600 runs, failure rate 20.0%" in body and "Latest failures" in body
    # Throughput, held work by reason and by account, the usage of each account on each queue apart.
    assert "Paused by an operator (exports)" in body and "acme (exports)" in body
    assert body.count('<svg class="chart"') == 1 + 2 + 3 * 2
    assert "tenant-2" in body and "http://" not in body.split("<body")[1].replace("http://www.w3.org", "")


@pytest.mark.parametrize("range_, buckets, runs", [("1h", 12, 12), ("24h", 24, 288), ("14d", 14, 2600),
                                                  ("recent", 34, 200)])
def test_the_throughput_panel_switches_its_range_and_is_served_as_json(client, root, account, range_, buckets, runs,
                                                                       django_assert_max_num_queries):
    """Runs every 5 minutes for a day (200, one in five failed) and 13 days of roll-ups (10
    succeeded and 10 failed each, from yesterday on): the last hour holds 12 of the runs, the day
    288 - but the history holds only 200 runs, so 200 - and 14 days the 200 plus 13 days' 20."""
    budgets_ensure_defaults(account=account)
    _history(account, 13)
    client.force_login(root)
    with django_assert_max_num_queries(8):
        data = client.get(reverse("ops-dashboard-panel", args=["throughput"]), {"range": range_, "format": "json"}).json()
    # "recent" starts at the first run, so its column count depends on where the first run falls in
    # a 30-minute column: one more when it falls late in one (the clock of the run, not the code).
    widths = {buckets, buckets + 1} if range_ == "recent" else {buckets}
    assert data["range"] == range_ and len(data["labels"]) == len(data["succeeded"]) == len(data["failed"])
    assert len(data["labels"]) in widths
    expected = {"1h": 12, "24h": 200, "recent": 200, "14d": 200 + 13 * 20}[range_]
    assert data["total"] == sum(data["succeeded"]) + sum(data["failed"]) == expected
    fragment = client.get(reverse("ops-dashboard-panel", args=["throughput"]), {"range": range_}).content.decode()
    assert f"{expected} runs, failure rate" in fragment
    page = client.get(reverse("ops-dashboard"), {"range": range_}).content.decode()
    assert f'class="range-{range_} current"' in page and f'panels/throughput/?range={range_}' in page


def test_the_charts_have_axes_with_units_and_values_on_hover(client, root, account):
    budgets_ensure_defaults(account=account)
    _history(account, 2)
    client.force_login(root)
    throughput = client.get(reverse("ops-dashboard-panel", args=["throughput"]), {"range": "24h"}).content.decode()
    # The y axis is labelled with its unit and a round top; the x axis with hours (UTC).
    assert ">runs</text>" in throughput and ">UTC, per hour</text>" in throughput and ":00</text>" in throughput
    # A full hour of runs every 5 minutes: 12, in a column whose tooltip says so.
    hour = (timezone.now() - dt.timedelta(hours=2)).strftime("%H:00")
    ok, failed = map(int, re.search(rf'data-tip="{hour}: succeeded (\d+), failed (\d+) runs"', throughput).groups())
    assert ok + failed == 12 and failed in (2, 3)
    assert f"<title>{hour}: succeeded {ok}, failed {failed} runs</title>" in throughput
    usage = client.get(reverse("ops-dashboard-panel", args=["usage"])).content.decode()
    # The standard plan: 3,600 CPU s a day on default, 1,800 on exports, each queue apart (never 5,400).
    assert ">CPU s</text>" in usage and "(limit 3,600)" in usage and "(limit 1,800)" in usage
    assert "5,400" not in usage
    held = client.get(reverse("ops-dashboard-panel", args=["held"]), {"format": "json"}).json()
    assert held["held"] == [] and held["unit"] == "held jobs"


def test_the_panels_and_their_json_are_scoped_like_the_page(client, account, operator):
    budgets_ensure_defaults(account=account)
    other = AccountFactory(slug="globex")
    budgets_ensure_defaults(account=other)
    _history(other, 2)
    DeferredTask.objects.create(account=other, queue="default", job="tests.noop", ref="x",
                                reason=DeferReason.CONCURRENCY_CAP, eligible_at=timezone.now())
    client.force_login(operator)
    usage = client.get(reverse("ops-dashboard-panel", args=["usage"]), {"format": "json"}).json()
    assert [(row["account"], row["queue"]) for row in usage["accounts"]] == [("acme", "default"), ("acme", "exports")]
    assert client.get(reverse("ops-dashboard-panel", args=["throughput"]), {"format": "json"}).json()["total"] == 0
    held = client.get(reverse("ops-dashboard-panel", args=["held"]), {"format": "json"}).json()
    assert held["held"] == [] and held["accounts"] == []  # globex's held job, by reason or by account
    for range_ in ("recent", "1h", "24h", "14d"):  # globex's failed runs are not named
        throughput = client.get(reverse("ops-dashboard-panel", args=["throughput"]), {"range": range_, "format": "json"})
        assert throughput.json()["latest_failures"] == []
    assert client.get(reverse("ops-dashboard-panel", args=["queues"])).status_code == 404  # the broker is everyone's
    assert client.get(reverse("ops-dashboard-panel", args=["nothing"])).status_code == 404
    client.logout()
    assert client.get(reverse("ops-dashboard-panel", args=["usage"])).status_code == 302  # to the login page


def _tenants(first: int, n: int) -> None:
    """`n` accounts from number `first` on, each with its budgets, today's ledger (account t<i>
    used i ms) and a held job."""
    from budgets import clock as budget_clock
    from budgets.models import Account

    now = budget_clock.now()
    accounts = Account.objects.bulk_create([Account(slug=f"t{i}", name=f"t{i}") for i in range(first, first + n)])
    Budget.objects.bulk_create([Budget(account=a, queue=q, cpu_seconds_per_day=600, max_concurrent=1)
                                for a in accounts for q in ("default", "exports")])
    UsageDay.objects.bulk_create([UsageDay(account=a, queue="default", day=budget_clock.budget_day(now),
                                           cpu_used_ms=first + i)
                                  for i, a in enumerate(accounts)])
    DeferredTask.objects.bulk_create([DeferredTask(account=a, queue="default", job="tests.noop", ref=f"held-{a.pk}",
                                                   reason=DeferReason.CONCURRENCY_CAP, eligible_at=now, in_line_since=now)
                                      for a in accounts])
    _analyze()


def _analyze() -> None:
    """The planner's statistics as autovacuum leaves them once such rows commit (an ANALYZE in the
    test's transaction counts its own rows): those an earlier test left say "empty", and with them
    PostgreSQL nests loops over what are 10,000 rows, a page taking minutes. What a page reads as
    its days' rows grow is tests/budgets/test_queries.py's (a new day the statistics do not know)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ANALYZE budgets_account, budgets_budget, budgets_usageday, scheduling_deferredtask, "
                       "scheduling_backlog")


def _queries(client, url: str) -> int:
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries)


def test_the_views_of_10000_accounts_make_as_many_queries_as_those_of_ten(client, root, midday):
    """The dashboard draws the busiest accounts, the account list and the holding area page them
    (counting at most 10,000 rows), `budget_status` and /metrics report the top ones: what each
    page asks is the same with 10 accounts or 10,000."""
    from io import StringIO

    from django.core.management import call_command

    pages = [reverse("ops-dashboard"), reverse("admin:budgets_account_changelist"), "/metrics",
             reverse("admin:scheduling_deferredtask_changelist")]
    client.force_login(root)
    _tenants(0, 10)
    few = [_queries(client, url) for url in pages]
    _tenants(10, 9990)
    many = [_queries(client, url) for url in pages]
    assert many == few
    out = StringIO()
    call_command("budget_status", "--top", "5", stdout=out)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines[1:6]] == ["t9999", "t9998", "t9997", "t9996", "t9995"]
    assert lines[-1] == "the 5 of 20000 budgets that used the most CPU today (--all for every one)"


def test_the_dashboard_shows_a_tenant_only_its_accounts(client, account, operator):
    budgets_ensure_defaults(account=account)
    other = AccountFactory(slug="globex")
    budgets_ensure_defaults(account=other)
    _history(other, 2)
    client.force_login(operator)
    body = client.get(reverse("ops-dashboard")).content.decode()
    assert "<strong>acme</strong>" in body and "globex" not in body
    assert "0 runs" in body and "Queues: depth" not in body  # the broker's figures are everyone's


def test_the_admin_index_links_the_dashboard(client, root):
    client.force_login(root)
    assert reverse("ops-dashboard") in client.get(reverse("admin:index")).content.decode()


def test_accounts_show_a_burn_down_bar_and_can_be_paused_from_the_admin(client, root, account):
    budgets_ensure_defaults(account=account)
    client.force_login(root)
    page = client.get(reverse("admin:budgets_account_changelist")).content.decode()
    assert page.count('class="burn-down"') == 2 and "0/" in page
    response = client.post(reverse("admin:budgets_account_changelist"),
                           {"action": "pause_accounts", "index": 0, "_selected_action": [account.pk]}, follow=True)
    assert "account acme: paused" in response.content.decode().lower()
    assert Pause.objects.filter(account=account).exists()
    assert LogEntry.objects.filter(user=root, change_message="Paused account acme").exists()


def test_a_failed_export_is_retried_from_the_admin_and_a_finished_one_has_a_download_link(client, root, account):
    failed = ExportRecord.objects.create(account=account, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 1),
                                         source="activity", status=ExportStatus.FAILED, error_class="ValueError",
                                         error_message="card ***")
    done = ExportRecord.objects.create(account=account, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 1),
                                       source="activity", status=ExportStatus.SUCCEEDED, row_count=3)
    client.force_login(root)
    page = client.get(reverse("admin:exports_exportrecord_change", args=[done.pk])).content.decode()
    assert reverse("exports:download", args=[done.pk]) in page
    response = client.post(reverse("admin:exports_exportrecord_changelist"),
                           {"action": "retry", "index": 0, "_selected_action": [failed.pk, done.pk]}, follow=True)
    text = response.content.decode().lower()
    assert f"export {failed.pk}: queued again" in text
    assert f"export {done.pk}: it is succeeded; only failed or cancelled exports can be retried" in text


def test_budgets_are_adjusted_through_a_form(client, root, account):
    budgets_ensure_defaults(account=account)
    budget = Budget.objects.get(account=account, queue="default")
    client.force_login(root)
    url = reverse("admin:budgets_budget_changelist")
    form = client.post(url, {"action": "adjust", "index": 0, "_selected_action": [budget.pk]})
    assert b"CPU seconds per day" in form.content
    client.post(url, {"action": "adjust", "index": 0, "_selected_action": [budget.pk], "apply": "1",
                      "cpu_seconds_per_day": "42", "today_only": "on"})
    assert Budget.objects.get(pk=budget.pk).cpu_seconds_per_day == 42


def test_schedules_show_their_last_run_from_our_records(client, root):
    sync_schedules()
    TaskRun.objects.create(job="exports.purge_expired", ref="schedule:purge-expired-exports", outcome=Outcome.SUCCEEDED,
                           started_at=timezone.now(), wall_ms=1250)
    client.force_login(root)
    page = client.get(reverse("admin:django_q_schedule_changelist")).content.decode()
    assert "1.25 s" in page and "succeeded" in page
    schedule = Schedule.objects.get(name="fairshare:purge-expired-exports")
    response = client.post(reverse("admin:django_q_schedule_changelist"),
                           {"action": "run_now", "index": 0, "_selected_action": [schedule.pk]}, follow=True)
    assert "fairshare:purge-expired-exports: sent to its queue" in response.content.decode().lower()


def test_a_queue_is_paused_from_the_admin_and_a_tenant_may_choose_only_its_accounts(client, root, account, operator):
    AccountFactory(slug="globex")
    operator.user_permissions.add(*Permission.objects.filter(codename__in=["view_pause", "add_pause"]))
    client.force_login(operator)
    form = client.get(reverse("admin:scheduling_pause_add")).content.decode()
    assert ">acme<" in form and "globex" not in form
    client.post(reverse("admin:scheduling_pause_add"), {"account": "", "queue": "exports"}, follow=True)
    assert not Pause.objects.exists()  # a queue belongs to no account: superusers only
    client.force_login(root)
    response = client.post(reverse("admin:scheduling_pause_add"), {"account": "", "queue": "exports"}, follow=True)
    assert "queue exports: paused" in response.content.decode().lower()
    assert Pause.objects.filter(account=None, queue="exports").exists()


def test_the_holding_area_says_what_each_job_waits_for_and_until_when(client, root, account):
    """ETA per job: its own time (a back-off), a resume, its account's budget (its line blocked
    until the next budget day), its rate limit, or a free worker (scheduling.waits)."""
    import datetime as dt

    from budgets import clock as budget_clock
    from scheduling import clock
    from scheduling.envelope import Envelope
    from scheduling.holding import hold

    now = clock.now()
    for ref, reason, eligible_at in [("backoff", DeferReason.RETRY_BACKOFF, now + dt.timedelta(minutes=4)),
                                     ("paused", DeferReason.PAUSED, dt.datetime(9999, 1, 1, tzinfo=dt.UTC)),
                                     ("slot", DeferReason.CONCURRENCY_CAP, now)]:
        hold(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", reason=reason,
             eligible_at=eligible_at)
    other = AccountFactory(slug="spent")
    hold(envelope=Envelope(job="tests.noop", account=other.pk, ref="budget"), queue="default",
         reason=DeferReason.BUDGET_EXHAUSTED, eligible_at=budget_clock.next_reset())
    limited = AccountFactory(slug="limited")  # at its rate limit for ten more minutes, a job behind
    for ref, reason in (("rate", DeferReason.RATE_LIMITED), ("behind-rate", DeferReason.QUEUED_BEHIND)):
        hold(envelope=Envelope(job="tests.noop", account=limited.pk, ref=ref), queue="default", reason=reason,
             eligible_at=now + dt.timedelta(minutes=10))
    client.force_login(root)

    page = client.get(reverse("admin:scheduling_deferredtask_changelist")).content.decode()

    assert "Holding area" in page and "Eligible from" in page
    assert "in 3\xa0minutes" in page or "in 4\xa0minutes" in page
    assert "when an operator resumes it" in page and "when a worker is free" in page
    # A line held up shows the line's reason and time, once: the next budget day, the rate window.
    assert f"{budget_clock.next_reset():%Y-%m-%d %H:%M} UTC (in " in page
    assert page.count("Account at its rate limit") == 2 + 1  # both jobs of limited's line, and the filter
    assert "Eligible at" not in page and "ETA" not in page


def test_a_held_jobs_page_releases_it_and_only_its_accounts_operators_see_it(client, root, account, operator):
    """The held job's page offers its list's action (release) as a button: it releases the job, says
    so and logs it; another account's held job is a 404, as is its release."""
    from scheduling import clock
    from scheduling.envelope import Envelope
    from scheduling.holding import hold

    for slug, ref in (("acme", "mine"), ("globex", "theirs")):
        owner = account if slug == "acme" else AccountFactory(slug=slug)
        hold(envelope=Envelope(job="tests.noop", account=owner.pk, ref=ref), queue="default",
             reason=DeferReason.CONCURRENCY_CAP, eligible_at=clock.now())
    mine, theirs = DeferredTask.objects.get(ref="mine"), DeferredTask.objects.get(ref="theirs")
    operator.user_permissions.add(Permission.objects.get(codename="view_deferredtask"))
    client.force_login(operator)

    page = client.get(reverse("admin:scheduling_deferredtask_change", args=[mine.pk])).content.decode()
    assert 'id="object-action-release"' in page and "Eligible from" in page and "when a worker is free" in page
    assert "Released to the queue at this time" in page  # the help text of a computed field
    assert client.get(reverse("admin:scheduling_deferredtask_change", args=[theirs.pk])).status_code == 404
    assert client.post(reverse("admin:scheduling_deferredtask_act", args=[theirs.pk, "release"])).status_code == 404
    assert client.get(reverse("admin:scheduling_deferredtask_act", args=[mine.pk, "release"])).status_code == 405

    # A viewer of acme sees the job but no button, and cannot release it by posting.
    from budgets.models import Role
    from tests.factories import MembershipFactory, UserFactory

    viewer = MembershipFactory(account=account, user=UserFactory(username="acme-viewer", is_staff=True),
                               role=Role.VIEWER).user
    viewer.user_permissions.add(Permission.objects.get(codename="view_deferredtask"))
    client.force_login(viewer)
    page = client.get(reverse("admin:scheduling_deferredtask_change", args=[mine.pk])).content.decode()
    assert "when a worker is free" in page and "object-action-release" not in page
    assert client.post(reverse("admin:scheduling_deferredtask_act", args=[mine.pk, "release"])).status_code == 404
    assert DeferredTask.objects.filter(ref="mine").exists()
    client.force_login(operator)

    response = client.post(reverse("admin:scheduling_deferredtask_act", args=[mine.pk, "release"]), follow=True)
    assert "released to the queue" in response.content.decode()
    assert response.redirect_chain[-1][0] == reverse("admin:scheduling_deferredtask_changelist")  # it is gone
    assert not DeferredTask.objects.filter(ref="mine").exists() and DeferredTask.objects.filter(ref="theirs").exists()
    assert LogEntry.objects.filter(user=operator, change_message__startswith="Released from the holding area").exists()


def test_a_runs_page_says_what_budget_exhausted_means_and_links_the_budget(client, root, account):
    budget = Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1, max_concurrent=1)
    run = TaskRun.objects.create(account=account, job="tests.spin", queue="default", ref="x" * 36, cpu_ms=1000,
                                 started_at=timezone.now(), outcome=Outcome.BUDGET_EXHAUSTED)
    client.force_login(root)
    page = client.get(reverse("admin:scheduling_taskrun_change", args=[run.pk])).content.decode()
    assert "daily CPU budget on this queue ran out" in page
    assert reverse("admin:budgets_budget_change", args=[budget.pk]) in page
    assert "CPU time (ms)" in page and "Peak memory (KB)" in page and "Cpu ms" not in page and "Peak rss" not in page
    assert "Error class" not in page  # no empty error section
    listing = client.get(reverse("admin:scheduling_taskrun_changelist")).content.decode()
    assert 'title="' + "x" * 36 + '"' in listing  # the long reference in short, whole on hover


def test_an_exports_page_shows_a_failure_section_and_the_actions_that_apply_to_it(client, root, account):
    export = ExportRecord.objects.create(account=account, source="activity", start_date=dt.date(2026, 1, 1),
                                         end_date=dt.date(2026, 1, 2), status=ExportStatus.SUCCEEDED, row_count=3)
    client.force_login(root)
    page = client.get(reverse("admin:exports_exportrecord_change", args=[export.pk])).content.decode()
    assert ">Failure<" not in page and "SHA-256 checksum" in page
    assert "object-action-retry" not in page and "object-action-cancel" not in page  # nothing to retry or cancel
    ExportRecord.objects.filter(pk=export.pk).update(status=ExportStatus.FAILED, error_class="RuntimeError")
    page = client.get(reverse("admin:exports_exportrecord_change", args=[export.pk])).content.decode()
    assert ">Failure<" in page and 'id="object-action-retry"' in page and "object-action-cancel" not in page
    listing = client.get(reverse("admin:exports_exportrecord_changelist")).content.decode()
    assert f'title="{export.pk}"' in listing and "0 of 5" in listing


def test_every_system_records_page_and_list_speak_in_human_labels(client, root, account):
    """No field name shown as Django spells it ("Cpu ms", "Peak rss kb", "Db wait ms")."""
    from budgets.models import BudgetAdjustment, Reservation
    from scheduling.models import WorkerHeartbeat

    now = timezone.now()
    budget = Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=60, max_concurrent=1)
    records = [
        TaskRun.objects.create(account=account, job="tests.noop", started_at=now, outcome=Outcome.SUCCEEDED),
        TaskRunDaily.objects.create(day=now.date(), account=account, job="tests.noop", queue="default",
                                    outcome=Outcome.SUCCEEDED, runs=1),
        UsageDay.objects.create(account=account, queue="default", day=now.date(), cpu_used_ms=5),
        Reservation.objects.create(account=account, queue="default", day=now.date(), job="tests.noop", ref="r",
                                   lease_expires_at=now),
        BudgetAdjustment.objects.create(budget=budget, cpu_seconds_per_day=120, previous_cpu_seconds=60),
        WorkerHeartbeat.objects.create(worker="vm:1", queue="default", seen_at=now),
        budget,
    ]
    client.force_login(root)
    for record in records:
        opts = record._meta
        for url in (reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[record.pk]),
                    reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")):
            text = re.sub(r"<[^>]+>", " ", client.get(url).content.decode().split('id="content"')[1])
            assert not re.search(r"\b(Cpu|Rss|rss|Db wait|wait ms|used ms|reserved ms)\b", text), (url, text)
    usage = client.get(reverse("admin:budgets_usageday_changelist")).content.decode()
    assert "CPU used (ms)" in usage and "Stopped at the cap" in usage
