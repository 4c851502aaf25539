"""What anyone is shown of a held job is its line's current reason and ETA (SPEC "Explained
waiting"), never the reason stored when it was held: an account that ran out of CPU today shows
every held job of its line as "out of CPU budget" until the next budget day, on every surface (the
holding area's admin, a task call's page, Fair share now, budget_status, /metrics), whether its
line was held up already or not yet."""
import datetime as dt
import json
import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.urls import reverse

from budgets import clock as budget_clock
from budgets.handoff import release_locked
from budgets.models import Budget, UsageDay
from scheduling import clock, holding
from scheduling.envelope import Envelope
from scheduling.models import Backlog, DeferReason, DeferredTask, NOT_BLOCKED
from scheduling.waits import why_held
from tests.scheduling.test_ops_endpoints import by, scrape

pytestmark = pytest.mark.django_db

OUT_OF_CPU = "Daily CPU budget exhausted"


@pytest.fixture
def spent(account):
    """acme spent today's CPU; its line holds jobs held earlier for other reasons (at its cap, behind
    its line), one retry still waiting for its own time."""
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1, max_concurrent=2)
    UsageDay.objects.create(account=account, queue="default", day=budget_clock.budget_day(), cpu_used_ms=1000)
    now = clock.now()
    holding.hold(envelope=Envelope(job="tests.noop", account=account.pk, ref="capped"), queue="default",
                 reason=DeferReason.CONCURRENCY_CAP, eligible_at=now)
    holding.hold_many(envelopes=[Envelope(job="tests.noop", account=account.pk, ref=f"behind-{i}") for i in range(3)],
                      queue="default", reason=DeferReason.QUEUED_BEHIND, eligible_at=now)
    holding.hold(envelope=Envelope(job="tests.noop", account=account.pk, ref="retry"), queue="default",
                 reason=DeferReason.RETRY_BACKOFF, eligible_at=now + dt.timedelta(hours=1))
    return account


@pytest.mark.parametrize("held_up", [False, True], ids=["line-not-held-up-yet", "line-held-up"])
def test_every_held_job_of_an_account_out_of_budget_says_so_with_the_next_budget_day(client, root, spent, held_up):
    if held_up:
        assert release_locked(account_id=spent.pk, queue="default") == 0  # its line is held up until then
        assert Backlog.objects.get(account=spent).blocked_until > NOT_BLOCKED
    next_day = budget_clock.next_reset(clock.now())
    in_line = DeferredTask.objects.filter(account=spent, in_line_since__isnull=False)
    assert in_line.count() == 4

    # The one question every surface asks.
    waits = why_held(list(DeferredTask.objects.all()))
    assert {waits[h.pk] for h in in_line} == {(DeferReason.BUDGET_EXHAUSTED, next_day)}
    assert waits[DeferredTask.objects.get(ref="retry").pk].reason == DeferReason.RETRY_BACKOFF  # its own time

    client.force_login(root)
    # The holding area's admin: every row in line says it, none says the reason it was held for.
    page = client.get(reverse("admin:scheduling_deferredtask_changelist")).content.decode()
    rows = re.search(r'<table id="result_list">.*?</table>', page, re.S).group(0)
    assert rows.count(OUT_OF_CPU) == 4 and "Queued behind" not in rows and "concurrency cap" not in rows
    assert rows.count(f"{next_day:%Y-%m-%d %H:%M} UTC (in ") == 4  # eligible from the next budget day
    held = in_line.first()
    assert OUT_OF_CPU in client.get(reverse("admin:scheduling_deferredtask_change", args=[held.pk])).content.decode()

    # Fair share now.
    [row] = client.get(reverse("ops-fairshare-table"), {"format": "json"}).json()["rows"]
    assert row["held_by_reason"] == {OUT_OF_CPU: 4, "Waiting to retry": 1}
    assert row["line_waits_for"] == {"reason": OUT_OF_CPU, "until": next_day.isoformat()}

    # budget_status.
    out = StringIO()
    call_command("budget_status", "--account", "acme", "--json", stdout=out)
    [status] = json.loads(out.getvalue())
    assert status["waiting"] == {"in_line": 4, "reason": OUT_OF_CPU, "until": next_day.isoformat()}
    out = StringIO()
    call_command("budget_status", "--account", "acme", stdout=out)
    assert f"4: {OUT_OF_CPU}, until {next_day:%Y-%m-%d %H:%M} UTC" in out.getvalue()

    # /metrics: the jobs in line by what they wait for, the retry by its own reason.
    held_metric = by(scrape()["fairshare_held_tasks"], "queue", "reason")
    assert held_metric == {("default", "budget_exhausted"): 4, ("default", "retry_backoff"): 1}
