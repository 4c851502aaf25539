"""The operator console in a real browser: Debian's chromium driven by Playwright, against a live
server and a real exports `qcluster`. An operator logs in, opens a failed export and sees its
redacted error, retries it and sees it succeed, pauses an account and sees its new work held with
that reason, resumes it and sees the work run, and runs a recurring export now. The dashboard's
screenshot is kept: the test's tmp dir and var/test-artifacts/console-dashboard.png; the second
test keeps the pages an operator meets under the demo's workload beside it.

scripts/test installs Playwright's package (requirements-dev.txt) and, as root, Debian's chromium;
Playwright's own browser download cannot work here. Without either, this test skips and says why
(and fails under CI=true: tests/services.py).
"""
import shutil
import time
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission
from django.db import connections

from budgets.models import Role
from exports import build
from exports.models import ExportRecord, ExportSchedule, ExportStatus
from exports.requests import BUILD_JOB, export_request
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask
from scheduling.runtime import execute
from tests.conftest import REPO
from tests.services import needs_service
from tests.exports.support import RANGE, add_events, notifications, stored_files, wait_finished
from tests.factories import MembershipFactory, UserFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]

CHROMIUM = "/usr/bin/chromium"
LAUNCH_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PASSWORD = "console-test-password"
ARTIFACTS = REPO / "var" / "test-artifacts"
# In the error, what the stored copy must not show: a card number and a connection string's password.
LEAKY = "could not complete export for card 4111 1111 1111 1111 at postgres://app:s3cr3t@db.internal/fs"

try:
    from playwright import sync_api
except ImportError:  # said by the `browser` fixture, at the test rather than at collection
    sync_api = None


@pytest.fixture
def browser(monkeypatch):
    if sync_api is None:
        needs_service("Playwright", "its Python package is not installed (scripts/test installs it from "
                      "requirements-dev.txt)")
    if not Path(CHROMIUM).exists():
        needs_service("chromium", f"no {CHROMIUM}: scripts/test installs Debian's chromium with apt-get when run "
                      "as root")
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # synchronous and safe, but Django refuses them inside a running loop unless told.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield chromium
        chromium.close()
        # Inside the loop Django's connection handler (context-local) gave the test its own
        # connections: close them, or the test database cannot be dropped at the end.
        connections.close_all()


class Console:
    """One signed-in admin session."""

    def __init__(self, browser, base_url: str, username: str):
        self.page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        self.base_url = base_url
        self.page.set_default_timeout(20_000)
        self.open("/admin/login/")
        self.page.fill("#id_username", username)
        self.page.fill("#id_password", PASSWORD)
        self.page.click("input[type=submit]")
        sync_api.expect(self.page.locator("#user-tools")).to_contain_text(username)

    def open(self, path: str):
        self.page.goto(self.base_url + path)
        return self.page

    def act(self, changelist: str, pk, action: str) -> str:
        """Select one row of a change list, run an admin action, return the messages shown."""
        page = self.open(changelist)
        page.check(f'input[name="_selected_action"][value="{pk}"]')
        page.select_option('select[name="action"]', action)
        page.click('button[name="index"]')
        return page.locator("ul.messagelist").inner_text()

    def text(self, path: str) -> str:
        return self.open(path).locator("#content").inner_text()


def _operator(account):
    user = UserFactory(username="acme-operator", is_staff=True)
    user.set_password(PASSWORD)
    user.save()
    MembershipFactory(account=account, user=user, role=Role.OPERATOR)
    user.user_permissions.add(*Permission.objects.filter(codename__in=[
        "view_exportrecord", "view_exportattempt", "view_account", "view_deferredtask", "view_exportschedule",
        "view_taskrun"]))
    return user


def _failed_after_publishing(record, monkeypatch) -> None:
    """The export's first attempt, run here: it publishes, then fails for good with an error that
    quotes a card number and a password."""
    def fail(point):
        if point == "after_publish":
            raise RuntimeError(LEAKY)
    with monkeypatch.context() as patch:
        patch.setattr(build, "fault_point", fail)
        execute(Envelope(job=BUILD_JOB, account=record.account_id, ref=str(record.pk)).to_message())
    record.refresh_from_db()
    assert record.status == ExportStatus.FAILED


def test_an_operator_runs_the_console_in_a_real_browser(
        live_server, browser, account, owner, export_root, mail_dir, start_exports, monkeypatch, tmp_path):
    add_events(account, 150)
    _operator(account)
    record, _ = export_request(account_slug="acme", user=owner, **RANGE)
    _failed_after_publishing(record, monkeypatch)
    cluster = start_exports()
    console = Console(browser, live_server.url, "acme-operator")
    exports = "/admin/exports/exportrecord/"

    # A failed export and its redacted error.
    page_text = console.text(f"{exports}{record.pk}/change/")
    assert "Failed" in page_text and "RuntimeError" in page_text
    assert "card ***" in page_text and "postgres://***@db.internal" in page_text
    assert "4111" not in page_text and "s3cr3t" not in page_text

    # Retry: the worker completes it from the object the failed attempt published.
    assert "queued again" in console.act(exports, record.pk, "retry")
    wait_finished(record, cluster)
    page_text = console.text(f"{exports}{record.pk}/change/")
    assert record.status == ExportStatus.SUCCEEDED and "Succeeded" in page_text and "download (150 rows)" in page_text
    assert len(stored_files(export_root)) == 2 and notifications(mail_dir, record) == 1  # one object (+ manifest)

    # Pause the account: its new work waits in the holding area with that reason.
    assert "paused" in console.act("/admin/budgets/account/", account.pk, "pause_accounts")
    paused, _ = export_request(account_slug="acme", user=owner, start=RANGE["start"], end=RANGE["start"])
    held = DeferredTask.objects.get(ref=str(paused.pk))
    assert held.reason == DeferReason.PAUSED
    holding_text = console.text("/admin/scheduling/deferredtask/")
    assert "Paused by an operator" in holding_text and "when an operator resumes it" in holding_text

    # Resume: the held export is released and runs.
    assert "released 1 held task(s)" in console.act("/admin/budgets/account/", account.pk, "resume_accounts")
    wait_finished(paused, cluster)
    assert paused.status == ExportStatus.SUCCEEDED
    assert "Succeeded" in console.text(f"{exports}{paused.pk}/change/")
    assert console.open("/admin/scheduling/deferredtask/").locator("#result_list").count() == 0  # nothing held

    # Run a recurring export now.
    schedule = ExportSchedule.objects.create(account=account, source="activity", requested_by=owner)
    assert "requested" in console.act("/admin/exports/exportschedule/", schedule.pk, "run_now")
    scheduled = ExportRecord.objects.get(idempotency_key__startswith=f"schedule-{schedule.pk}-")
    wait_finished(scheduled, cluster)
    assert scheduled.status == ExportStatus.SUCCEEDED

    # The dashboard, as a superuser sees it, kept as an artifact.
    root = UserFactory(username="root", is_staff=True, is_superuser=True)
    root.set_password(PASSWORD)
    root.save()
    admin = Console(browser, live_server.url, "root")
    dashboard = admin.open("/admin/")
    dashboard.click("#ops-dashboard-link a")
    sync_api.expect(dashboard.locator("#dashboard")).to_contain_text("Throughput, since")
    shot = tmp_path / "console-dashboard.png"
    dashboard.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / shot.name)
    # The queue table, the 24 h throughput and acme's usage against its budget as charts; nothing held.
    assert dashboard.locator("#queues table").count() == 1
    # Throughput; acme's CPU on the exports queue, its budget apart from the default queue's.
    assert dashboard.locator("#throughput svg").count() == 1
    assert dashboard.locator('#usage .usage-row[data-account="acme"][data-queue="exports"] svg').count() == 1
    assert "nothing to show" in dashboard.locator("#held").inner_text()
    assert "3 runs" in dashboard.locator("#throughput").inner_text() or "runs, failure rate" in dashboard.content()


def _unclipped(page) -> bool:
    """Whether the change list's table fits its box at this width (nothing to scroll sideways to)."""
    widths = page.evaluate("""() => [document.querySelector('#changelist .results'), document.querySelector('#result_list')]
        .filter(Boolean).map(e => [e.scrollWidth, e.clientWidth, e.parentElement.clientWidth])""")
    assert all(scroll <= client + 1 and scroll <= parent + 1 for scroll, client, parent in widths), (page.url, widths)
    return True


def _keep(page, name: str, tmp_path) -> Path:
    """A full-page screenshot, in the test's tmp dir and var/test-artifacts/."""
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, ARTIFACTS / name)
    return ARTIFACTS / name


def test_the_dashboard_and_fair_share_now_follow_the_demo_workload_live(
        live_server, browser, start_cluster, start_exports, tmp_path):
    """The demo's workload (exports/demo.py) against real default and exports clusters: globex's
    flood waits at its cap and is worked off, initech's light jobs run beside it, umbrella's work
    waits for its CPU budget, acme's recurring export completes. The fair-share view, refreshed by
    its own script (the page is never reloaded), shows globex's held count fall; the charts show a
    value on hover; the search finds an account. At 1400x1000, under that load: the holding area is
    named so and no list clips a column, a held job's page releases it, a failed task run and task
    call read in words, the dashboard's default range shows the work and its failure, an export's
    page has no empty Failure section; each page is kept as a screenshot (var/test-artifacts/)."""
    import datetime as dt

    from django.utils import timezone

    from budgets.models import Budget
    from exports import demo
    from exports.sample_data import add_activity
    from scheduling.models import Outcome, TaskRun
    from scheduling.runtime import enqueue

    accounts = demo.ensure_accounts()
    Budget.objects.filter(account=accounts[demo.CAPPED], queue="default").update(cpu_seconds_per_day=1)
    add_activity(accounts[demo.EXPORTER], 200, since=timezone.now() - dt.timedelta(days=7), span_s=7 * 86400)
    jobs = "tests.jobs,exports.demo"
    start_cluster("default", FAIRSHARE_EXTRA_JOB_MODULES=jobs)
    start_exports(FAIRSHARE_EXTRA_JOB_MODULES=jobs)
    root = UserFactory(username="root", is_staff=True, is_superuser=True)
    root.set_password(PASSWORD)
    root.save()
    console = Console(browser, live_server.url, "root")
    page = console.open("/admin/")
    page.click("#ops-fairshare-link a")
    sync_api.expect(page.locator("#fairshare")).to_be_visible()

    # The flood: 80 jobs at once, most of them held at globex's cap; then the rest of the workload.
    held_at_first = demo.flood(accounts[demo.FLOOD], 80)
    assert held_at_first >= 70
    for second in range(1, 5):
        demo.step(accounts, second)
    for i in range(6):  # 2.4 CPU s of work for umbrella's 1 CPU s a day
        enqueue(job=demo.JOB, account=accounts[demo.CAPPED].pk, ref=f"{demo.CAPPED_MS}/cap-{i}")
    page = console.open("/admin/fairshare/?refresh=2")
    page.evaluate("window.notReloaded = true")
    globex_held = page.locator('tr[data-account="globex"][data-queue="default"] .held')
    shown = int(globex_held.inner_text())
    assert shown >= 40
    # Work runs; the script fetches the table again and the number falls, without a reload.
    sync_api.expect(globex_held).not_to_have_text(str(shown), timeout=30_000)
    assert int(globex_held.inner_text()) < shown and page.evaluate("window.notReloaded") is True
    sync_api.expect(page.locator("#live-status")).to_contain_text("updated")
    # umbrella's work waits for its budget; initech, light, holds nothing.
    umbrella = page.locator('tr[data-account="umbrella"][data-queue="default"]')
    sync_api.expect(umbrella.locator(".held")).not_to_have_text("0", timeout=30_000)
    sync_api.expect(umbrella).to_contain_text("budget exhausted", timeout=30_000)
    # Hover: the share cell says how many workers that is.
    page.locator('tr[data-account="globex"][data-queue="default"] td.share').first.hover()
    sync_api.expect(page.locator("#chart-tip")).to_contain_text("worker(s) busy on average")
    fairshare_shot = _keep(page, "fairshare-under-load.png", tmp_path)

    # The holding area under the flood, named so, every column visible at 1400 px; a held job's page
    # with its release button, kept while it is held.
    page = console.open("/admin/scheduling/deferredtask/?account__id__exact=%d" % accounts[demo.FLOOD].pk)
    sync_api.expect(page.locator("#content h1")).to_contain_text("Holding area")
    sync_api.expect(page.locator("p.paginator")).to_contain_text("held jobs")
    _keep(page, "holding-area.png", tmp_path)
    assert page.locator("#result_list tbody tr").count() > 0 and _unclipped(page)
    assert "ELIGIBLE FROM" in page.locator("#result_list thead").inner_text().upper()
    # umbrella's, held until its next budget day, stays held while the page is opened (globex's go).
    page = console.open("/admin/scheduling/deferredtask/?account__id__exact=%d" % accounts[demo.CAPPED].pk)
    page.locator("#result_list tbody tr th a").first.click()
    sync_api.expect(page.locator("#object-action-release")).to_be_visible()
    sync_api.expect(page.locator("#content")).to_contain_text("Eligible from")
    _keep(page, "held-job.png", tmp_path)
    page.click("#object-action-release")  # back to the queue: its list says so (its budget may hold it again)
    sync_api.expect(page.locator("ul.messagelist")).to_contain_text("released to the queue")
    assert console.open("/admin/").locator("#content-main").inner_text().count("Holding area") == 1

    # A task that fails for good, on its run's page: its outcome said in words, its error redacted.
    enqueue(job="tests.leak", account=accounts[demo.LIGHT].pk, ref="api-token/1")
    deadline = time.monotonic() + 60
    while not (failed := TaskRun.objects.filter(job="tests.leak", outcome=Outcome.FAILED).first()):
        assert time.monotonic() < deadline, "the failing task never ran"
        time.sleep(0.5)
    page = console.open(f"/admin/scheduling/taskrun/{failed.pk}/change/")
    sync_api.expect(page.locator("#content")).to_contain_text("It failed for good")
    assert "fs_PlantedToken" not in page.locator("#content").inner_text()
    _keep(page, "failed-task.png", tmp_path)

    # Django task calls: one that fails, and globex's, held behind its flood; their list fits at 1400 px.
    from tasks.models import TaskCall
    from tests.tasks import functions

    call = functions.failing_value_error.enqueue(account=accounts[demo.LIGHT])
    for i in range(3):
        functions.echo.enqueue(i, account=accounts[demo.FLOOD])
    deadline = time.monotonic() + 60
    while TaskCall.objects.get(pk=call.id).status != "FAILED":
        assert time.monotonic() < deadline, "the failing task call never ran"
        time.sleep(0.5)
    page = console.open(f"/admin/tasks/taskcall/{call.id}/change/")
    sync_api.expect(page.locator("#content")).to_contain_text("This task failed due to ValueError")
    assert page.locator("#object-action-retry").count() == 1
    _keep(page, "failed-task-call.png", tmp_path)
    page = console.open("/admin/tasks/taskcall/")
    _keep(page, "list-taskcall-under-load.png", tmp_path)
    assert page.locator("#result_list tbody tr").count() >= 4 and _unclipped(page)

    # The dashboard under the same load: its default range shows the work from its first minute, the
    # failure is named; a column's value on hover; the range switched.
    page = console.open("/admin/dashboard/?refresh=2")
    sync_api.expect(page.locator("#throughput h2")).to_contain_text("since")
    summary = page.locator("#throughput-summary").inner_text()
    assert int(summary.split(" runs")[0]) > 0, summary
    sync_api.expect(page.locator("#latest-failures")).to_contain_text("tests.leak")
    sync_api.expect(page.locator("#held-by-account")).to_contain_text("globex (default)")
    column = page.locator("#throughput svg rect[fill='transparent']").first  # the first run's minute
    column.hover()
    sync_api.expect(page.locator("#chart-tip")).to_contain_text("succeeded")
    assert "runs" in page.locator("#chart-tip").inner_text()
    assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
    dashboard_shot = _keep(page, "dashboard-under-load.png", tmp_path)
    page.click("a.range-1h")
    sync_api.expect(page.locator("#throughput h2")).to_contain_text("last hour, per 5 minutes")

    # Search: the top-N finds an account by its name.
    page = console.open("/admin/fairshare/")
    page.fill("#fairshare-q", "Umbre")
    page.click("#fairshare-search button[type=submit]")
    rows = page.locator("tr.fairshare-row")
    sync_api.expect(rows.first).to_have_attribute("data-account", "umbrella")
    assert {rows.nth(i).get_attribute("data-account") for i in range(rows.count())} == {"umbrella"}

    # acme's recurring export completed on the exports cluster.
    from exports.models import ExportRecord, ExportStatus

    demo.request_export(accounts[demo.EXPORTER], slot=1)
    export = ExportRecord.objects.get(account=accounts[demo.EXPORTER])
    deadline = time.monotonic() + 60
    while export.status != ExportStatus.SUCCEEDED and time.monotonic() < deadline:
        time.sleep(0.5)
        export.refresh_from_db()
    assert export.status == ExportStatus.SUCCEEDED
    page = console.open(f"/admin/exports/exportrecord/{export.pk}/change/")
    sync_api.expect(page.locator("#content")).to_contain_text("Succeeded")
    assert page.locator("fieldset h2", has_text="Failure").count() == 0  # no empty Failure section
    assert page.locator("#object-action-retry").count() == 0  # a succeeded export has nothing to retry
    _keep(page, "export.png", tmp_path)

    # Every list readable at 1400 px: no column clipped, long ids in short.
    for changelist in ("/admin/exports/exportrecord/", "/admin/tasks/taskcall/", "/admin/scheduling/deferredtask/",
                       "/admin/scheduling/taskrun/"):
        page = console.open(changelist)
        _keep(page, "list-" + changelist.strip("/").split("/")[-1] + ".png", tmp_path)
        assert _unclipped(page), changelist
    assert fairshare_shot.stat().st_size > 10_000 and dashboard_shot.stat().st_size > 10_000
