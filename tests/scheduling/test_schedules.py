"""Cron schedules declared in code, synced into django-q2 Schedule rows (idempotently)."""
import dataclasses
import datetime as dt
import io

import pytest
from croniter import croniter
from django.core.management import call_command
from django.utils import timezone
from django_q.models import Schedule

from scheduling.runtime import RUNNER
from scheduling.schedules import PREFIX, SCHEDULES, CronSchedule, sync_schedules

pytestmark = pytest.mark.django_db


def rows() -> set[tuple]:
    return set(Schedule.objects.values_list("name", "func", "args", "cron", "next_run", "cluster"))


def declared_names(declared=SCHEDULES) -> set[str]:
    return {PREFIX + s.name for s in declared}


def with_cron(name: str, cron: str) -> tuple[CronSchedule, ...]:
    return tuple(dataclasses.replace(s, cron=cron) if s.name == name else s for s in SCHEDULES)


def test_syncing_twice_leaves_the_same_rows():
    Schedule.objects.filter(name__startswith=PREFIX).delete()

    first = sync_schedules()
    after_first = rows()
    second = sync_schedules()

    assert first == {"created": len(SCHEDULES), "updated": 0, "deleted": 0, "unchanged": 0}
    assert second == {"created": 0, "updated": 0, "deleted": 0, "unchanged": len(SCHEDULES)}
    assert rows() == after_first
    assert {r[0] for r in after_first} == declared_names()
    # Every schedule fires the one runner with an identifiers-only envelope, on its job's queue.
    purge = Schedule.objects.get(name=PREFIX + "purge-expired-exports")
    assert purge.func == RUNNER
    assert purge.args == repr({"v": 2, "job": "exports.purge_expired", "account": None,
                               "ref": "schedule:purge-expired-exports", "priority": 0})
    assert purge.schedule_type == Schedule.CRON and purge.repeats == -1


def test_a_changed_cron_expression_moves_next_run_to_the_new_expressions_next_time():
    sync_schedules()
    name = PREFIX + "rollup-task-runs"
    old = Schedule.objects.get(name=name)
    assert old.cron == "23 3 * * *"
    others_before = {r for r in rows() if r[0] != name}

    before = timezone.now()
    counts = sync_schedules(with_cron("rollup-task-runs", "*/5 * * * *"))
    after = timezone.now()

    assert counts["updated"] == 1 and counts["unchanged"] == len(SCHEDULES) - 1
    row = Schedule.objects.get(name=name)
    assert row.cron == "*/5 * * * *"
    expected = {croniter("*/5 * * * *", t).get_next(dt.datetime) for t in (before, after)}
    assert row.next_run in expected
    assert row.next_run != old.next_run
    assert row.next_run.minute % 5 == 0 and row.next_run > before
    # The other rows, next_run included, are untouched.
    assert {r for r in rows() if r[0] != name} == others_before

    # And back: next_run follows the declaration again.
    sync_schedules()
    assert Schedule.objects.get(name=name).next_run.time().replace(second=0, microsecond=0) == dt.time(3, 23)


def test_a_removed_declaration_removes_its_row_and_leaves_other_schedules_alone():
    sync_schedules()
    theirs = Schedule.objects.create(name="nightly-crm-sync", func="crm.tasks.sync", schedule_type=Schedule.CRON,
                                     cron="0 2 * * *")
    unnamed = Schedule.objects.create(func="crm.tasks.ping", schedule_type=Schedule.MINUTES, minutes=5)
    kept = tuple(s for s in SCHEDULES if s.name != "prune-django-q")

    counts = sync_schedules(kept)

    assert counts == {"created": 0, "updated": 0, "deleted": 1, "unchanged": len(kept)}
    assert not Schedule.objects.filter(name=PREFIX + "prune-django-q").exists()
    assert set(Schedule.objects.filter(name__startswith=PREFIX).values_list("name", flat=True)) == declared_names(kept)
    theirs.refresh_from_db()
    assert (theirs.func, theirs.cron) == ("crm.tasks.sync", "0 2 * * *")
    assert Schedule.objects.filter(pk=unnamed.pk).exists()

    # Declaring it again brings it back.
    assert sync_schedules()["created"] == 1


def test_a_hand_edited_row_is_put_back_to_its_declaration():
    sync_schedules()
    name = PREFIX + "release-deferred"
    Schedule.objects.filter(name=name).update(func="somewhere.else", cluster="exports")

    counts = sync_schedules()

    assert counts["updated"] == 1
    row = Schedule.objects.get(name=name)
    assert (row.func, row.cluster) == (RUNNER, None)


def test_the_management_command_prints_the_counts():
    Schedule.objects.filter(name__startswith=PREFIX).delete()
    out = io.StringIO()

    call_command("sync_schedules", stdout=out)
    call_command("sync_schedules", stdout=out)

    n = len(SCHEDULES)
    assert out.getvalue().splitlines() == [
        f"{n} created, 0 updated, 0 deleted, 0 unchanged",
        f"0 created, 0 updated, 0 deleted, {n} unchanged",
    ]
