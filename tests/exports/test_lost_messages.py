"""On the Redis broker a message is delivered at most once: a worker killed after fetching it, or a
Redis restart, loses it. The reconciler turns every such loss into latency, not only for exports
(tests/exports/test_recovery.py, test_crash.py) but for each kind of work that matters:

- held work released into a slot: reclaim-leases finds its dispatched slot unused after
  FAIRSHARE_DISPATCH_LEASE and puts the job back in the holding area, to be sent again;
- recurring exports and maintenance: every schedule is a sweep of what is due, so the tick after a
  lost one does its work (a recurring export's period is still due, an expired lease still expired).
"""
import datetime as dt

import pytest
import redis
from django.utils import timezone
from django_q.models import Schedule
from django_q.scheduler import scheduler

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus
from budgets.reclaim import reclaim_expired
from exports.models import ExportRecord, ExportSchedule, ExportStatus, SchedulePeriod
from scheduling import processes
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue
from scheduling.schedules import sync_schedules
from tests.budgets.test_processes import wait
from tests.exports.conftest import FAST_RECOVERY

# Work is sent as in production with workers beating before it (their pulses may not have beaten yet).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes, pytest.mark.usefixtures("beating_workers"),
              pytest.mark.parametrize("broker", ["redis"], indirect=True)]


def lose_every_message(broker) -> None:
    """What a Redis restart (or a killed worker that had fetched them) does to queued messages."""
    redis.from_url(broker.env["REDIS_URL"]).flushdb()


def test_held_work_whose_released_message_was_lost_is_sent_again_and_runs(broker, account, start_cluster):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1_000, max_concurrent=1)
    assert enqueue(job="tests.noop", account=account.pk, ref="lost") is not None  # into the one slot
    assert enqueue(job="tests.noop", account=account.pk, ref="held") is None  # waits behind it
    lose_every_message(broker)
    # The dispatch lease runs out (FAIRSHARE_DISPATCH_LEASE, 5 minutes by default).
    Reservation.objects.update(lease_expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert reclaim_expired() == 1  # what the reclaim-leases schedule does every minute

    assert DeferredTask.objects.filter(ref="lost", reason=DeferReason.MESSAGE_LOST).exists()
    cluster = start_cluster("default", **broker.env)
    wait(lambda: TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).count() == 2, timeout=60,
         what="both jobs to run", clusters=[cluster])
    assert sorted(TaskRun.objects.values_list("ref", flat=True)) == ["held", "lost"]  # once each
    assert not DeferredTask.objects.exists()


def test_a_lost_schedule_tick_is_done_by_the_next_tick(broker, account, owner, start_cluster):
    ExportSchedule.objects.create(account=account, requested_by=owner, period=SchedulePeriod.DAILY,
                                  at_time=dt.time(0, 0))
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1_000, max_concurrent=2)
    # A run that died holding a slot: its lease ran out, reclaim-leases gives the slot back.
    dead = Reservation.objects.create(account=account, queue="default", day=clock.budget_day(), job="tests.noop",
                                      ref="dead", status=ReservationStatus.ACTIVE, cpu_reserved_ms=10,
                                      lease_expires_at=timezone.now() - dt.timedelta(minutes=1))
    sync_schedules()
    Schedule.objects.update(next_run=timezone.now())
    scheduler()  # a tick: every schedule's message goes to Redis...
    assert Schedule.objects.filter(next_run__gt=timezone.now()).count() == Schedule.objects.count()
    lose_every_message(broker)  # ...and is lost with it

    since = timezone.now()
    clusters = [start_cluster(queue, **FAST_RECOVERY, **broker.env) for queue in ("default", "exports")]
    processes.wait_ready(clusters, {"default": 1, "exports": 1}, since=since)
    assert not ExportRecord.objects.exists() and not TaskRun.objects.exists()  # nothing ran the lost tick

    # The next tick (the next minute, at most 30 s late: django-q2's scheduler pass).
    wait(lambda: ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED).exists()
         and Reservation.objects.filter(pk=dead.pk, status=ReservationStatus.RECLAIMED).exists(),
         timeout=150, interval=0.5, what="the next tick's recurring export and reclaim", clusters=clusters)
    assert ExportRecord.objects.count() == 1
    assert TaskRun.objects.filter(job="exports.run_schedules", outcome=Outcome.SUCCEEDED).count() >= 1
