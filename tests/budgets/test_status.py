"""`manage.py budget_status`: what an operator reads to see where an account's budget went."""
import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from budgets import clock
from budgets.models import Budget, UsageDay
from budgets.admission import admit
from scheduling.envelope import Envelope
from scheduling.runtime import enqueue
from scheduling.services import task_run_new

# Their workers run (their heartbeats beat): work goes to the broker as far as they could start it.
pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("beating_workers")]


def status(*args) -> str:
    out = StringIO()
    call_command("budget_status", *args, stdout=out)
    return out.getvalue()


def test_budget_status_shows_use_reservations_slots_and_held_work(account, other_account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=2)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day(), cpu_used_ms=2500)
    admit(envelope=Envelope(job="tests.noop", account=account.pk, ref="running"), queue="default",
          estimate_ms=10, worker="w")
    assert enqueue(job="tests.noop", account=account.pk, ref="sent") is not None
    assert enqueue(job="tests.noop", account=account.pk, ref="held") is None  # both slots taken

    [row] = json.loads(status("--account", account.slug, "--json"))
    assert row == {
        "account": account.slug, "queue": "default", "day": clock.budget_day().isoformat(),
        "cpu_limit_ms": 10_000, "cpu_used_ms": 2500, "cpu_reserved_ms": 1000, "cpu_remaining_ms": 6500,
        "running": 1, "sent": 1, "max_concurrent": 2, "held": 1, "weight": 1, "rate_limit": None,
        # What its line waits for now (budgets.waits): both slots are taken.
        "waiting": {"in_line": 1, "reason": "Account at its concurrency cap", "until": None},
        "next_reset": clock.next_reset().isoformat(),
    }
    table = status("--account", account.slug)
    assert table.splitlines()[1].split() == [account.slug, "default", "10.0", "2.5", "1.0", "6.5", "1/2", "1", "1",
                                             "1", "-", "1:", "Account", "at", "its", "concurrency", "cap,", "when",
                                             "one", "of", "its", "runs", "ends"]
    assert f"next reset {clock.next_reset():%Y-%m-%d %H:%M}" in table


def test_budget_status_of_an_unknown_account_is_an_error():
    with pytest.raises(CommandError, match="No account 'nope'"):
        status("--account", "nope")


def test_budget_status_shows_the_weight_and_how_close_the_account_is_to_its_rate_limit(account):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=10, max_concurrent=5, weight=3,
                          rate_starts=2, rate_period_s=30)
    for ref in ("a", "b"):
        admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default", estimate_ms=10,
              worker="w", run=task_run_new(job="tests.noop", queue="default", account_id=account.pk, ref=ref))

    [row] = json.loads(status("--account", account.slug, "--json"))
    assert row["weight"] == 3
    assert row["rate_limit"] == {"starts": 2, "period_s": 30, "recent_starts": 2, "reached": True}
    assert status("--account", account.slug).splitlines()[1].split()[-6:] == ["3", "2/2", "per", "30", "s", "-"]
