"""The relay and the replay against real NATS servers: the shared one (a stream of the test's
own) and a private one the test stops and starts again."""
import io
import subprocess
import sys

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, UsageDay
from scheduling import processes
from scheduling.models import WorkerHeartbeat
from tests.usage.test_outbox import QUEUE, settle, slot_running
from usage import ops, replay
from usage.models import UsageEvent
from usage.relay import relay_once
from usage.sinks import NatsSink, SinkUnavailable

pytestmark = [pytest.mark.django_db(transaction=True)]


@pytest.fixture
def acme(account):
    Budget.objects.create(account=account, queue=QUEUE, cpu_seconds_per_day=100, max_concurrent=50)
    UsageDay.objects.create(account=account, queue=QUEUE, day=clock.budget_day())
    return account


def settle_runs(account, n: int, tag: str = "r") -> None:
    day = clock.budget_day()
    for i in range(n):
        settle(account, slot_running(account, day, f"{tag}{i}"), cpu_ms=10 + i, wall_ms=20 + i)


def stream_events(settings) -> list[dict]:
    return list(replay.read_stream(settings.FAIRSHARE["USAGE_NATS_URL"], replay.Start()))


def replay_check(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    try:
        call_command("usage_replay", "--since", clock.budget_day().isoformat(), *args, stdout=out)
    except SystemExit as exc:
        return int(exc.code), out.getvalue()
    return 0, out.getvalue()


def test_the_relay_publishes_in_order_and_deletes_what_the_stream_stored(acme, usage_on, stream, settings):
    settle_runs(acme, 5)
    written = list(UsageEvent.objects.order_by("id").values_list("event_id", flat=True))
    sink = NatsSink(stream["USAGE_NATS_URL"])
    try:
        assert relay_once(sink) == 5
    finally:
        sink.close()
    assert not UsageEvent.objects.exists()
    assert [e["id"] for e in stream_events(settings)] == [str(i) for i in written]
    code, out = replay_check("--check")
    assert (code, out.splitlines()[-1]) == (0, "0 differences"), out


def test_check_prints_a_damaged_ledger_and_restore_repairs_it(acme, usage_on, stream):
    settle_runs(acme, 3)
    call_command("usage_relay", "--once", stdout=io.StringIO())
    UsageDay.objects.filter(account=acme).update(cpu_used_ms=0, runs=99)
    code, out = replay_check("--check")
    assert code == 1
    assert f"account {acme.pk} queue {QUEUE} day {clock.budget_day()}: cpu_used_ms ledger 0 log 33" in out
    assert "runs ledger 99 log 3" in out and out.splitlines()[-1] == "2 differences"

    WorkerHeartbeat.objects.create(worker="host:1", queue=QUEUE, seen_at=timezone.now())
    with pytest.raises(CommandError, match="workers are running"):
        replay_check("--restore")
    WorkerHeartbeat.objects.all().delete()
    assert replay_check("--restore")[0] == 0
    row = UsageDay.objects.get(account=acme)
    assert (row.cpu_used_ms, row.runs) == (33, 3)
    assert replay_check("--check")[0] == 0


def relay_process(settings, **env: str) -> subprocess.CompletedProcess:
    conf = settings.FAIRSHARE
    environ = processes.worker_env(
        DJANGO_SETTINGS_MODULE="config.settings", FAIRSHARE_TESTING="1",
        FAIRSHARE_USAGE_NATS_URL=conf["USAGE_NATS_URL"], FAIRSHARE_USAGE_STREAM=conf["USAGE_STREAM"],
        FAIRSHARE_USAGE_SUBJECT_PREFIX=conf["USAGE_SUBJECT_PREFIX"], FAIRSHARE_USAGE_MAX_BYTES=str(conf["USAGE_MAX_BYTES"]),
        FAIRSHARE_USAGE_RELAY_BATCH="4", **env)
    return subprocess.run([sys.executable, "manage.py", "usage_relay", "--once"], env=environ,
                          capture_output=True, text=True, timeout=60)


def test_a_relay_killed_between_publish_and_delete_publishes_nothing_twice(acme, usage_on, stream, settings):
    settle_runs(acme, 10)
    killed = relay_process(settings, FAIRSHARE_FAULT="usage_after_publish")
    assert killed.returncode == -9, killed.stderr
    assert UsageEvent.objects.count() == 10  # published (a batch of 4), not deleted
    done = relay_process(settings)
    assert done.returncode == 0, done.stderr
    assert not UsageEvent.objects.exists()
    events = stream_events(settings)
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids)) == 10  # the stream dropped the 4 published again
    assert replay.rebuild(events, first_day=clock.budget_day(), last_day=clock.budget_day()).duplicates == 0


def test_nats_down_keeps_the_events_reports_the_lag_and_catches_up(acme, usage_on, private_nats, settings):
    settle_runs(acme, 3, tag="before")
    sink = NatsSink(private_nats.url)
    try:
        assert relay_once(sink) == 3
        private_nats.kill()
        settle_runs(acme, 4, tag="during")
        with pytest.raises(SinkUnavailable):
            relay_once(sink)
        assert UsageEvent.objects.count() == 4  # nothing lost, nothing deleted
        settings.FAIRSHARE = {**settings.FAIRSHARE, "USAGE_RELAY_BEHIND_S": 0}
        assert ops.usage_relay_keeps_up().startswith("behind: 4 events wait")
        lag = {m.name: m.samples[0].value for m in ops.usage_metrics()}
        assert lag["fairshare_usage_relay_lag_events"] == 4 and lag["fairshare_usage_relay_lag_seconds"] >= 0

        private_nats.start()  # the same store: what it had stored, it keeps
        assert relay_once(sink) == 4
    finally:
        sink.close()
    assert not UsageEvent.objects.exists() and ops.usage_relay_keeps_up() is None
    assert sorted(e["ref"] for e in stream_events(settings)) == sorted(
        [f"before{i}" for i in range(3)] + [f"during{i}" for i in range(4)])
    assert replay_check("--check")[0] == 0
