"""A worker frozen past its lease (SIGSTOP, as a VM pause or a long stop would), then woken
(SIGCONT): while it is frozen its slot is reclaimed and its account's next job runs in it; when
it wakes it finds the slot gone at its next budget tick and either takes a free one again or
stops, recorded as such, its job held again. The account never runs more jobs than its cap once
the worker is back, and the ledger counts every run once (SPEC §4 Faults)."""
import datetime as dt
import os
import signal

import pytest
from django.db.models import Sum
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.reclaim import reclaim_expired
from scheduling.models import Outcome, TaskRun
from scheduling.runtime import enqueue
from tests.budgets.test_processes import wait

# Work is sent as in production with workers beating before it (their pulses may not have beaten yet).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes, pytest.mark.usefixtures("beating_workers")]

# Leases of seconds: a worker frozen for a few is past its lease.
FAST_LEASES = {"FAIRSHARE_RESERVATION_LEASE": "2", "FAIRSHARE_RESERVATION_HEARTBEAT": "0.5",
               "FAIRSHARE_WORKERS": "2", "FAIRSHARE_TASK_TIMEOUT": "60"}


def running(ref: str) -> TaskRun | None:
    return TaskRun.objects.filter(ref=ref, outcome=Outcome.RUNNING).first()


def freeze_past_its_lease(account, ref: str, cluster) -> tuple[int, TaskRun]:
    """Wait for the run of `ref` to hold its slot, SIGSTOP its worker process, and reclaim the slot
    once its lease expired (as the reclaim schedule would). Returns the worker's pid and the run."""
    wait(lambda: running(ref) is not None, timeout=30, what=f"{ref} to start", clusters=[cluster])
    run = running(ref)
    pid = int(run.worker.rsplit(":", 1)[1])
    os.kill(pid, signal.SIGSTOP)
    wait(lambda: Reservation.objects.filter(account=account, ref=ref, lease_expires_at__lt=timezone.now()).exists(),
         timeout=10, what="the frozen run's lease to expire")
    assert reclaim_expired() == 1
    assert Reservation.objects.get(ref=ref).status == ReservationStatus.RECLAIMED
    assert TaskRun.objects.get(pk=run.pk).outcome == Outcome.LOST  # as far as anyone can tell
    return pid, run


def ledger_is_exact(account) -> None:
    """Every run that held a slot is charged once, with what it recorded, and nothing is left held."""
    day = UsageDay.objects.get(account=account, queue="default", day=clock.budget_day())
    runs = TaskRun.objects.filter(account=account).exclude(outcome=Outcome.DEFERRED)
    assert (day.runs, day.cpu_used_ms, day.cpu_reserved_ms) == (
        runs.count(), runs.aggregate(cpu=Sum("cpu_ms"))["cpu"], 0)
    assert not Reservation.objects.exists()


def test_a_woken_run_whose_slot_went_to_the_next_job_stops_and_runs_again_after_it(account, start_cluster):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1000, max_concurrent=1)
    cluster = start_cluster("default", **FAST_LEASES)
    assert enqueue(job="tests.sleep_checked", account=account.pk, ref="20000/frozen") is not None
    assert enqueue(job="tests.sleep", account=account.pk, ref="4000/next") is None  # cap 1: held
    pid, frozen = freeze_past_its_lease(account, "20000/frozen", cluster)
    try:
        # The freed slot went to the account's next job, which runs while the first is frozen.
        wait(lambda: running("4000/next") is not None, timeout=30, what="the next job to start", clusters=[cluster])
    finally:
        os.kill(pid, signal.SIGCONT)
    woke_at = timezone.now()

    wait(lambda: TaskRun.objects.filter(pk=frozen.pk, outcome=Outcome.SLOT_LOST).exists(), timeout=30,
         what="the woken run to stop", clusters=[cluster])
    nxt = TaskRun.objects.get(ref="4000/next")
    frozen.refresh_from_db()
    # It stopped at its next tick, beside the job that took its slot, not 20 s of work later.
    assert nxt.finished_at is None or frozen.finished_at < nxt.finished_at
    assert frozen.finished_at < woke_at + dt.timedelta(seconds=10)
    # Its job waited for a slot and ran again once the next job had finished: nothing lost, and
    # outside the freeze the account never ran two jobs at once.
    wait(lambda: TaskRun.objects.filter(ref="20000/frozen", outcome=Outcome.SUCCEEDED).exists(), timeout=60,
         what="the stopped job to run again", clusters=[cluster])
    again = TaskRun.objects.get(ref="20000/frozen", outcome=Outcome.SUCCEEDED)
    nxt.refresh_from_db()
    assert again.started_at >= nxt.finished_at
    wait(lambda: not Reservation.objects.exists(), timeout=10, what="the last run to settle")
    ledger_is_exact(account)


def test_a_woken_run_takes_a_free_slot_again_and_finishes(account, start_cluster):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=1000, max_concurrent=1)
    cluster = start_cluster("default", **FAST_LEASES)
    assert enqueue(job="tests.sleep_checked", account=account.pk, ref="3000/frozen") is not None
    pid, frozen = freeze_past_its_lease(account, "3000/frozen", cluster)
    os.kill(pid, signal.SIGCONT)  # nothing else of the account's waited: its slot is free

    # It holds its slot again (counted against the cap: the account's next job waits for it) ...
    wait(lambda: Reservation.objects.filter(ref="3000/frozen", status=ReservationStatus.ACTIVE).exists(),
         timeout=10, what="the woken run to take its slot again", clusters=[cluster])
    assert enqueue(job="tests.sleep", account=account.pk, ref="500/after") is None
    wait(lambda: TaskRun.objects.filter(ref="500/after", outcome=Outcome.SUCCEEDED).exists(), timeout=30,
         what="the next job to run", clusters=[cluster])
    # ... and goes on to finish, once, as the same run; the next job ran after it.
    frozen.refresh_from_db()
    assert frozen.outcome == Outcome.SUCCEEDED and TaskRun.objects.filter(ref="3000/frozen").count() == 1
    assert TaskRun.objects.get(ref="500/after").started_at >= frozen.finished_at
    wait(lambda: not Reservation.objects.exists(), timeout=10, what="the run to settle")
    ledger_is_exact(account)
