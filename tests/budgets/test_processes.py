"""Budgets and fairness with real processes: `qcluster` workers and `multiprocessing` settlers.

What a user of the account would notice: the usage ledger adds up to the millisecond, the daily
cap stops work close to the cap and work resumes the next budget day, the concurrency cap holds,
one account's flood does not hold up another, a dead worker's run is reclaimed and counted once,
and waiting for budget never costs an export an attempt.
"""
import datetime as dt
import multiprocessing
import os
import signal
import socket
import time

import pytest
from django.db.models import Count, Sum
from django.utils import timezone

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from budgets.admission import admit
from budgets.handoff import release_due
from budgets.reclaim import reclaim_expired
from budgets.settlement import settle
from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from scheduling.envelope import Envelope
from scheduling.gates import Wait
from scheduling.holding import release_now
from scheduling.metering import Meter
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue, send
from scheduling.waits import why_held
from tests.budgets.settlers import meter_figures, settle_runs
from tests.conftest import wait_for, worker_env
from tests.factories import AccountFactory, ActivityEventFactory

# Work is sent as in production with workers beating before it (their pulses may not have beaten yet).
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes, pytest.mark.usefixtures("beating_workers")]

# Runs that held a slot and were settled (a deferred run never was).
ADMITTED = (Outcome.SUCCEEDED, Outcome.FAILED, Outcome.BUDGET_EXHAUSTED)
# Fast lease renewals, so a run's reported CPU and lease are fresh within half a second.
FAST_BEAT = {"FAIRSHARE_RESERVATION_HEARTBEAT": "0.5"}


def give_budget(account, *, cpu_seconds: int, max_concurrent: int, queue: str = "default") -> Budget:
    return Budget.objects.create(account=account, queue=queue, cpu_seconds_per_day=cpu_seconds,
                                 max_concurrent=max_concurrent)


def usage(account, *, day: dt.date | None = None, queue: str = "default") -> UsageDay:
    return UsageDay.objects.get(account=account, queue=queue, day=day or clock.budget_day())


def runs_of(account, **filters):
    return TaskRun.objects.filter(account=account, **filters)


def wait(predicate, *, timeout: float, what: str, clusters=(), interval: float = 0.1):
    """wait_for, with the tail of each worker log in the failure message."""
    try:
        return wait_for(predicate, timeout=timeout, interval=interval, message=what)
    except pytest.fail.Exception:
        logs = "\n".join(f"--- {c.log_path.name}\n{c.log()[-6000:]}" for c in clusters)
        pytest.fail(f"timed out after {timeout}s waiting for {what}\n{logs}")


def ledger_totals(account, day: dt.date) -> dict[str, int]:
    row = usage(account, day=day)
    return {"cpu_ms": row.cpu_used_ms, "wall_ms": row.wall_ms, "db_wait_ms": row.db_wait_ms,
            "storage_wait_ms": row.storage_wait_ms, "runs": row.runs}


def recorded_totals(runs) -> dict[str, int]:
    sums = runs.aggregate(cpu_ms=Sum("cpu_ms"), wall_ms=Sum("wall_ms"), db_wait_ms=Sum("db_wait_ms"),
                          storage_wait_ms=Sum("storage_wait_ms"), runs=Count("pk"))
    return {k: v or 0 for k, v in sums.items()}


# --- The ledger -------------------------------------------------------------------------------

def test_ledger_is_exact_under_concurrent_settlements_from_four_processes(account, export_root):
    give_budget(account, cpu_seconds=1_000_000, max_concurrent=4)
    processes, runs_each = 4, 250
    ctx = multiprocessing.get_context("spawn")
    together = ctx.Barrier(processes)  # all four settle against the same account at once
    env = worker_env(export_root)
    children = [ctx.Process(target=settle_runs, args=(env, w, runs_each, account.pk, together))
                for w in range(processes)]
    for child in children:
        child.start()
    deadline = time.monotonic() + 300  # generous: a bound for a hung child, not a speed target
    for child in children:
        child.join(max(0.0, deadline - time.monotonic()))
    for child in children:
        if child.is_alive():
            child.kill()
            child.join()
    assert [c.exitcode for c in children] == [0] * processes

    figures = [meter_figures(w, i) for w in range(processes) for i in range(runs_each)]
    expected = {
        "cpu_ms": sum(f[0] for f in figures), "wall_ms": sum(f[1] for f in figures),
        "db_wait_ms": sum(round(f[2]) for f in figures), "storage_wait_ms": sum(round(f[3]) for f in figures),
        "runs": processes * runs_each,
    }
    day = clock.budget_day()
    assert ledger_totals(account, day) == expected
    row = usage(account, day=day)
    assert (row.cpu_reserved_ms, row.deferrals) == (0, 0)
    assert not Reservation.objects.exists()


def test_ledger_matches_the_task_runs_of_real_workers(account, start_cluster):
    give_budget(account, cpu_seconds=100_000, max_concurrent=2)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")
    jobs = 200
    for i in range(jobs):
        # Two go to the broker (the account's two slots); the rest wait in the holding area and
        # are released one by one as runs settle.
        enqueue(job="tests.noop", account=account.pk, ref=f"0/{i}")

    wait(lambda: runs_of(account, outcome=Outcome.SUCCEEDED).values("ref").distinct().count() == jobs,
         timeout=90, what=f"{jobs} no-op jobs to succeed", clusters=[cluster])
    wait(lambda: not runs_of(account, outcome=Outcome.RUNNING).exists(), timeout=10,
         what="every run to be recorded", clusters=[cluster])

    admitted = runs_of(account, outcome__in=ADMITTED)
    recorded = recorded_totals(admitted)
    assert recorded["runs"] == jobs
    assert ledger_totals(account, clock.budget_day()) == recorded
    assert usage(account).cpu_reserved_ms == 0


# --- The daily cap ----------------------------------------------------------------------------

@pytest.mark.parametrize("job", ["tests.spin", "tests.spin_checked"])
def test_daily_cap_stops_work_near_the_cap_and_held_work_runs_the_next_budget_day(
    account, start_cluster, settings, job,
):
    # tests.spin never checks its budget (only RLIMIT_CPU can stop it); tests.spin_checked
    # checks between 50 ms slices like a well-behaved long job.
    give_budget(account, cpu_seconds=2, max_concurrent=2)
    today = clock.budget_day()
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_TASK_TIMEOUT="30", **FAST_BEAT)

    assert enqueue(job=job, account=account.pk, ref="5000/big") is not None
    capped = wait(lambda: runs_of(account, ref="5000/big", outcome=Outcome.BUDGET_EXHAUSTED).first(),
                  timeout=40, what="the spinning job to hit the daily cap", clusters=[cluster])

    spent = usage(account, day=today)
    # Stopped within about a second of the cap (a watcher tick, in practice), checked or not.
    assert 2000 <= spent.cpu_used_ms <= 2000 + 1000, spent.cpu_used_ms
    assert spent.cap_hits == 1 and spent.cpu_reserved_ms == 0
    assert capped.cpu_ms == spent.cpu_used_ms
    # The job that hit the cap waits for the next budget day, and so does the account's new work.
    assert enqueue(job="tests.spin", account=account.pk, ref="200/next-1") is None
    assert enqueue(job="tests.spin_checked", account=account.pk, ref="200/next-2") is None
    held = DeferredTask.objects.filter(account=account)
    assert sorted(held.values_list("ref", "reason")) == [
        ("200/next-1", DeferReason.BUDGET_EXHAUSTED), ("200/next-2", DeferReason.BUDGET_EXHAUSTED),
        ("5000/big", DeferReason.BUDGET_EXHAUSTED)]
    assert release_due() == 0  # not before the budget day rolls over

    # The budget day rolls over: for the workers and for this process alike.
    cluster.stop()
    settings.FAIRSHARE = {**settings.FAIRSHARE, "CLOCK_OFFSET_S": 86400}
    tomorrow = clock.budget_day()
    assert tomorrow == today + dt.timedelta(days=1)
    rolled_over = timezone.now()
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_TASK_TIMEOUT="30",
                            FAIRSHARE_CLOCK_OFFSET="86400", **FAST_BEAT)
    # (The scheduled release-deferred job may get there first; either way they are released, as
    # many as the account has slots, and each settlement releases the next.)
    release_due()

    def followups_done():
        return runs_of(account, ref__in=["200/next-1", "200/next-2"], outcome=Outcome.SUCCEEDED,
                       started_at__gte=rolled_over).count() == 2
    wait(followups_done, timeout=40, what="the held follow-up jobs to succeed the next day", clusters=[cluster])
    wait(lambda: runs_of(account, ref="5000/big", started_at__gte=rolled_over).exclude(
        outcome__in=[Outcome.RUNNING, Outcome.DEFERRED]).exists(),
        timeout=40, what="the capped job to run again the next day", clusters=[cluster])

    assert usage(account, day=today).cpu_used_ms == spent.cpu_used_ms  # yesterday is closed
    assert usage(account, day=tomorrow).runs == 3


def test_daily_cap_holds_when_one_accounts_runs_spin_at_the_same_time(account, start_cluster):
    give_budget(account, cpu_seconds=2, max_concurrent=2)  # the standard plan allows 2 at once
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_TASK_TIMEOUT="30", **FAST_BEAT)
    enqueue(job="tests.spin", account=account.pk, ref="5000/a")
    enqueue(job="tests.spin_checked", account=account.pk, ref="5000/b")
    wait(lambda: runs_of(account, outcome=Outcome.BUDGET_EXHAUSTED).count() == 2, timeout=60,
         what="both spinning jobs to be stopped", clusters=[cluster])
    wait(lambda: not Reservation.objects.filter(account=account).exists(), timeout=10,
         what="both runs to settle", clusters=[cluster])
    spent = usage(account)
    # Each run spends only what it reserved, and together they never reserve more than is left.
    assert 2000 <= spent.cpu_used_ms <= 2000 + 1000, spent.cpu_used_ms
    assert (spent.cap_hits, spent.cpu_reserved_ms) == (2, 0)
    # Both held again, and both shown out of CPU budget until the next budget day, whichever reason
    # each was held for (the first one stopped while the other still had budget reserved).
    held = list(DeferredTask.objects.filter(account=account))
    assert sorted(h.ref for h in held) == ["5000/a", "5000/b"]
    assert set(why_held(held).values()) == {Wait(DeferReason.BUDGET_EXHAUSTED, clock.next_reset())}


# --- Concurrency and fairness -----------------------------------------------------------------

def test_concurrency_cap_of_one_runs_jobs_one_at_a_time_and_loses_none(account, start_cluster):
    give_budget(account, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")
    refs = [f"300/{i}" for i in range(10)]
    sent = [enqueue(job="tests.sleep", account=account.pk, ref=ref) for ref in refs]
    # The first took the only slot on its way to the broker; the rest wait in the holding area.
    assert sent[0] is not None and sent.count(None) >= len(refs) - 2

    wait(lambda: runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs), timeout=45,
         what="all ten jobs to succeed", clusters=[cluster])
    wait(lambda: not DeferredTask.objects.filter(account=account).exists()
         and not runs_of(account, outcome=Outcome.RUNNING).exists(),
         timeout=10, what="the holding area to drain", clusters=[cluster])

    succeeded = list(runs_of(account, outcome=Outcome.SUCCEEDED).values_list("ref", flat=True))
    assert sorted(succeeded) == sorted(refs)  # each exactly once
    admitted = list(runs_of(account, outcome__in=ADMITTED).order_by("started_at"))
    for before, after in zip(admitted, admitted[1:]):
        assert before.finished_at <= after.started_at, (
            f"{before.ref} ran {before.started_at}..{before.finished_at}, "
            f"{after.ref} started {after.started_at}")
    assert usage(account).runs == len(refs)


def test_one_accounts_flood_does_not_hold_up_another_account(start_cluster):
    noisy, quiet = AccountFactory(slug="noisy"), AccountFactory(slug="quiet")
    give_budget(noisy, cpu_seconds=1000, max_concurrent=1)
    give_budget(quiet, cpu_seconds=1000, max_concurrent=2)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")

    # The flood arrives while the noisy account is busy: its only slot is taken, by the same
    # admission a worker uses, until the whole flood is in.
    busy = admit(envelope=Envelope(job="tests.sleep", account=noisy.pk, ref="0/busy"), queue="default",
                 estimate_ms=10, worker="test")
    assert busy.admitted
    flood = 200
    for i in range(flood):
        # Held at enqueue (no free slot: the first cause the rule finds, before "behind its line"):
        # the broker never sees them, so they cannot queue in front of anyone else's work.
        assert enqueue(job="tests.sleep", account=noisy.pk, ref=f"50/noisy-{i}") is None
    assert DeferredTask.objects.filter(account=noisy, reason=DeferReason.CONCURRENCY_CAP).count() == flood
    stopped = Meter()
    stopped.stop()
    settle(slot_id=busy.slot_id, account_id=noisy.pk, queue="default", meter=stopped)

    # The noisy account now runs its flood, one job at a time, while the quiet one submits.
    for i in range(5):
        enqueue(job="tests.sleep", account=quiet.pk, ref=f"50/quiet-{i}")  # two slots: two go at once
    wait(lambda: runs_of(quiet, outcome=Outcome.SUCCEEDED).count() == 5, timeout=40,
         what="the quiet account's five jobs", clusters=[cluster])
    noisy_done = runs_of(noisy, outcome=Outcome.SUCCEEDED).count()
    assert noisy_done < flood // 2, noisy_done
    # The flood is not dropped: it waits in the holding area and keeps running.
    assert DeferredTask.objects.filter(account=noisy).count() >= flood // 2
    wait(lambda: runs_of(noisy, outcome=Outcome.SUCCEEDED).count() > max(noisy_done, 1), timeout=20,
         what="the noisy account to keep making progress", clusters=[cluster])


# --- A worker dies mid-run --------------------------------------------------------------------

def test_a_killed_workers_run_is_reclaimed_rerun_and_charged_once(account, start_cluster):
    give_budget(account, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_RESERVATION_LEASE="3",
                            FAIRSHARE_TASK_TIMEOUT="30", **FAST_BEAT)
    ref = "3000/crash"
    enqueue(job="tests.spin_checked", account=account.pk, ref=ref)

    # Kill it once its watcher has reported some of its CPU.
    wait(lambda: Reservation.objects.filter(account=account, cpu_reported_ms__gte=300).exists(), timeout=30,
         what="the long job to run and report CPU", clusters=[cluster])
    victim = runs_of(account, ref=ref, outcome=Outcome.RUNNING).get()
    host, pid = victim.worker.rsplit(":", 1)
    assert host == socket.gethostname() and int(pid) != cluster.pid
    os.kill(int(pid), signal.SIGKILL)

    # The broker would redeliver only after `retry` (90 s here); ring the doorbell as it would.
    # The dead run holds the account's only slot until its pool's sentinel gives it back, at once
    # (or the reclaim, once its lease expired): the redelivery runs then, in that slot.
    send(job="tests.spin_checked", account=account.pk, ref=ref)

    def reclaimed():
        reclaim_expired()
        return runs_of(account, pk=victim.pk, outcome=Outcome.LOST).exists()
    wait(reclaimed, timeout=20, interval=0.5, what="the dead run's slot to be given back", clusters=[cluster])
    rerun = wait(lambda: runs_of(account, ref=ref, outcome=Outcome.SUCCEEDED).first(), timeout=40,
                 what="the job to run again and succeed", clusters=[cluster])

    victim.refresh_from_db()
    assert victim.cpu_ms >= 300 and victim.finished_at is not None
    assert Reservation.objects.get(task_run=victim).status == ReservationStatus.RECLAIMED
    row = usage(account)
    assert row.cpu_used_ms == victim.cpu_ms + rerun.cpu_ms
    assert (row.runs, row.cpu_reserved_ms) == (2, 0)
    assert runs_of(account, outcome__in=ADMITTED).count() == 1


# --- Exports: waiting for budget costs no attempt ---------------------------------------------

def test_an_export_held_for_budget_spends_no_attempt_and_completes_once(account, owner, start_cluster):
    for day in range(1, 4):
        ActivityEventFactory(account=account, occurred_at=dt.datetime(2026, 3, day, 12, tzinfo=dt.UTC))
    budget = give_budget(account, cpu_seconds=1, max_concurrent=1, queue="exports")
    scope = {"account_slug": account.slug, "user": owner, "start": dt.date(2026, 3, 1), "end": dt.date(2026, 3, 31)}

    # Requested while there is budget: its doorbell is rung. Then the day's budget is spent
    # before a worker gets to it, so admission holds it when it starts.
    at_start, _ = export_request(**scope, idempotency_key="held-at-start")
    UsageDay.objects.update_or_create(account=account, queue="exports", day=clock.budget_day(),
                                      defaults={"cpu_used_ms": 1000})
    # Requested once the budget is spent: held at once, the broker never sees it.
    at_enqueue, _ = export_request(**scope, idempotency_key="held-at-enqueue")
    cluster = start_cluster("exports", FAIRSHARE_EXPORT_WORKERS="2")

    exports = [at_start, at_enqueue]
    refs = [str(e.pk) for e in exports]
    wait(lambda: DeferredTask.objects.filter(ref__in=refs, reason=DeferReason.BUDGET_EXHAUSTED).count() == 2
         and runs_of(account, ref=str(at_start.pk), outcome=Outcome.DEFERRED).exists(),
         timeout=30, what="both exports to wait in the holding area", clusters=[cluster])
    for export in exports:
        export.refresh_from_db()
        assert (export.status, export.attempt_count) == (ExportStatus.QUEUED, 0)
        assert not export.attempts.exists()

    # An operator raises the budget and releases them; with one slot they take turns.
    Budget.objects.filter(pk=budget.pk).update(cpu_seconds_per_day=100)
    assert release_now(deferred_ids=list(DeferredTask.objects.filter(ref__in=refs).values_list("pk", flat=True))) == 2
    # (The record completes inside the run; the run is settled and recorded just after.)
    wait(lambda: ExportRecord.objects.filter(pk__in=refs, status=ExportStatus.SUCCEEDED).count() == 2
         and runs_of(account, ref__in=refs, outcome=Outcome.SUCCEEDED).count() == 2,
         timeout=40, what="both exports to succeed", clusters=[cluster])

    for export in exports:
        export.refresh_from_db()
        assert (export.attempt_count, export.row_count) == (1, 3)
        assert list(export.attempts.values_list("outcome", flat=True)) == ["succeeded"]
    assert usage(account, queue="exports").runs == 2
