"""Maintenance jobs on seeded data: each does its work, and running it twice changes nothing more."""
import datetime as dt
import hashlib
import io
from collections import defaultdict

import pytest
from django.utils import timezone
from django_q.models import OrmQ, Task
from django_q.signing import SignedPackage

from budgets import clock
from budgets.models import Budget, Reservation, ReservationStatus, UsageDay
from exports import storage
from exports.leases import export_complete
from exports.maintenance import purge_expired_exports
from exports.models import ExportRecord, ExportStatus
from scheduling.envelope import Envelope
from scheduling.holding import hold
from scheduling.metering import Meter
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.runtime import execute
from tests.factories import AccountFactory

pytestmark = pytest.mark.django_db

DAY = dt.timedelta(days=1)


def run_job(job: str) -> TaskRun:
    """Run a scheduled job the way its schedule does: through the runner, with its envelope."""
    ref = f"schedule:test-{job}"
    execute({"v": 1, "job": job, "account": None, "ref": ref})
    return TaskRun.objects.filter(job=job, ref=ref).order_by("-pk").first()


def queued_refs() -> list[str]:
    return [SignedPackage.loads(q.payload)["args"][0]["ref"] for q in OrmQ.objects.order_by("id")]


# --- Purging expired exports ----------------------------------------------------------------

def published_export(account, *, finished_days_ago: float, status=ExportStatus.SUCCEEDED, settings) -> ExportRecord:
    """An export finished `finished_days_ago`, with its file really stored (object + manifest)."""
    record = ExportRecord.objects.create(
        account=account, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 1), source="activity",
        status=ExportStatus.RUNNING, lease_epoch=1,
    )
    key = storage.object_key(account_id=account.pk, export_id=record.pk)
    if status == ExportStatus.SUCCEEDED:
        body = b'"occurred_at"\n"2026-03-01T00:00:00Z"\n'
        digest = hashlib.sha256(body).hexdigest()
        storage.publish(key=key, fileobj=io.BytesIO(body), manifest=storage.Manifest(
            export_id=str(record.pk), sha256=digest, rows=1, byte_size=len(body)), meter=Meter())
        # Completed the way the export job completes it (retention from the account or the default)...
        assert export_complete(
            export_id=record.pk, epoch=1, key=key, rows=1, byte_size=len(body), checksum=digest,
            retention_days=account.export_retention_days or settings.FAIRSHARE["EXPORT_RETENTION_DAYS"],
        )
    else:
        ExportRecord.objects.filter(pk=record.pk).update(status=status, completed_at=timezone.now())
    # ...then time passes.
    shift = dt.timedelta(days=finished_days_ago)
    record.refresh_from_db()
    ExportRecord.objects.filter(pk=record.pk).update(
        completed_at=record.completed_at - shift,
        expires_at=record.expires_at - shift if record.expires_at else None,
    )
    return record


def stored(record: ExportRecord) -> bool:
    key = storage.object_key(account_id=record.account_id, export_id=record.pk)
    return storage.export_storage().exists(key) or storage.export_storage().exists(storage.manifest_key(key))


def test_purge_deletes_expired_exports_with_their_files_and_keeps_the_rest(account, settings, export_root):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "EXPORT_RETENTION_DAYS": 7}
    long_keeper = AccountFactory(slug="keeps-30-days", export_retention_days=30)
    short_keeper = AccountFactory(slug="keeps-1-day", export_retention_days=1)

    expired = [
        published_export(account, finished_days_ago=8, settings=settings),           # default 7 days
        published_export(long_keeper, finished_days_ago=31, settings=settings),      # its own 30 days
        published_export(short_keeper, finished_days_ago=1.5, settings=settings),    # its own 1 day
        published_export(account, finished_days_ago=8, status=ExportStatus.FAILED, settings=settings),
        published_export(short_keeper, finished_days_ago=2, status=ExportStatus.CANCELLED, settings=settings),
    ]
    kept = [
        published_export(account, finished_days_ago=0, settings=settings),
        published_export(account, finished_days_ago=6, settings=settings),
        published_export(long_keeper, finished_days_ago=10, settings=settings),      # default would purge it
        published_export(long_keeper, finished_days_ago=10, status=ExportStatus.FAILED, settings=settings),
        published_export(short_keeper, finished_days_ago=0.5, settings=settings),
    ]
    queued = ExportRecord.objects.create(account=account, start_date=dt.date(2026, 3, 1),
                                         end_date=dt.date(2026, 3, 1), source="activity")
    succeeded = [r for r in expired + kept if r.status == ExportStatus.SUCCEEDED]
    assert len(succeeded) == 7 and all(stored(r) for r in succeeded)
    files_before = sorted(p.name for p in export_root.rglob("*") if p.is_file())

    run = run_job("exports.purge_expired")

    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, len(expired))
    assert set(ExportRecord.objects.values_list("pk", flat=True)) == {r.pk for r in kept} | {queued.pk}
    assert not any(stored(r) for r in expired)
    assert all(stored(r) for r in kept if r.status == ExportStatus.SUCCEEDED)
    files_after = sorted(p.name for p in export_root.rglob("*") if p.is_file())
    assert len(files_after) == len(files_before) - 2 * 3  # object + manifest of the 3 succeeded ones

    # Idempotent: the second run finds nothing more to do.
    again = run_job("exports.purge_expired")
    assert (again.outcome, again.items) == (Outcome.SUCCEEDED, 0)
    assert sorted(p.name for p in export_root.rglob("*") if p.is_file()) == files_after
    assert ExportRecord.objects.count() == len(kept) + 1


def test_purge_of_an_export_whose_file_is_already_gone_still_removes_the_record(account, settings):
    record = published_export(account, finished_days_ago=30, settings=settings)
    storage.delete(key=storage.object_key(account_id=account.pk, export_id=record.pk))  # a crash mid-purge

    assert purge_expired_exports() == 1
    assert not ExportRecord.objects.filter(pk=record.pk).exists()


# --- Rolling up task runs -------------------------------------------------------------------

def daily_sums() -> dict[tuple, list[int]]:
    return {
        (d.day, d.account_id, d.job, d.queue, d.outcome): [d.runs, d.cpu_ms, d.wall_ms, d.db_wait_ms,
                                                            d.storage_wait_ms, d.items]
        for d in TaskRunDaily.objects.all()
    }


def seed_task_runs(account, other_account) -> list[TaskRun]:
    now = timezone.now()
    spec = [
        # (days ago, account, job, queue, outcome, cpu, wall, db, storage, items)
        (20, account, "exports.build", "exports", Outcome.SUCCEEDED, 1200, 3000, 900, 200, 5000),
        (20, account, "exports.build", "exports", Outcome.SUCCEEDED, 800, 2000, 500, 100, 3000),
        (20, account, "exports.build", "exports", Outcome.RETRYING, 10, 40, 30, 0, 0),
        (20, other_account, "exports.build", "exports", Outcome.SUCCEEDED, 400, 900, 300, 50, 700),
        (19, account, "tests.noop", "default", Outcome.SUCCEEDED, 3, 5, 2, 0, 1),
        (19, account, "tests.noop", "default", Outcome.SUCCEEDED, 4, 6, 2, 0, 1),
        (19, None, "scheduling.release_deferred", "default", Outcome.SUCCEEDED, 7, 9, 8, 0, 2),
        (19, None, "scheduling.release_deferred", "default", Outcome.SUCCEEDED, 5, 8, 6, 0, 0),
        (15, account, "exports.build", "exports", Outcome.LOST, 300, 0, 0, 0, 0),
    ]
    runs = []
    for i, (days, acct, job, queue, outcome, cpu, wall, db, st, items) in enumerate(spec):
        started = now - dt.timedelta(days=days, minutes=i)
        runs.append(TaskRun.objects.create(
            account=acct, job=job, queue=queue, ref=f"old-{i}", started_at=started,
            finished_at=started + dt.timedelta(milliseconds=wall), outcome=outcome, cpu_ms=cpu, wall_ms=wall,
            db_wait_ms=db, storage_wait_ms=st, items=items,
        ))
    return runs


def test_rollup_folds_old_runs_into_daily_sums_and_keeps_recent_and_unfinished_ones(account, other_account):
    old = seed_task_runs(account, other_account)
    recent = TaskRun.objects.create(account=account, job="tests.noop", ref="recent",
                                    started_at=timezone.now() - dt.timedelta(days=2),
                                    finished_at=timezone.now() - dt.timedelta(days=2), outcome=Outcome.SUCCEEDED,
                                    cpu_ms=1, wall_ms=1, items=1)
    stuck = TaskRun.objects.create(account=account, job="exports.build", queue="exports", ref="stuck",
                                   started_at=timezone.now() - dt.timedelta(days=30))  # still "running"
    expected = defaultdict(lambda: [0] * 6)
    for r in old:
        key = (r.started_at.astimezone(dt.UTC).date(), r.account_id, r.job, r.queue, r.outcome)
        for i, v in enumerate((1, r.cpu_ms, r.wall_ms, r.db_wait_ms, r.storage_wait_ms, r.items)):
            expected[key][i] += v

    run = run_job("scheduling.rollup_task_runs")

    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, len(old))
    daily = daily_sums()
    assert daily == expected
    # Sums over everything equal the originals.
    assert sum(v[0] for v in daily.values()) == len(old)
    assert sum(v[1] for v in daily.values()) == sum(r.cpu_ms for r in old)
    assert not TaskRun.objects.filter(pk__in=[r.pk for r in old]).exists()
    assert TaskRun.objects.filter(pk__in=[recent.pk, stuck.pk]).count() == 2

    # Idempotent: nothing left to fold, the sums stay.
    again = run_job("scheduling.rollup_task_runs")
    assert (again.outcome, again.items) == (Outcome.SUCCEEDED, 0)
    assert daily_sums() == daily


def test_rollup_adds_to_an_existing_day_instead_of_overwriting_it(account, other_account):
    seed_task_runs(account, other_account)
    run_job("scheduling.rollup_task_runs")
    day = (timezone.now() - dt.timedelta(days=20)).astimezone(dt.UTC).date()
    before = TaskRunDaily.objects.get(day=day, account=account, job="exports.build", outcome=Outcome.SUCCEEDED)
    started = dt.datetime.combine(day, dt.time(12), tzinfo=dt.UTC)
    TaskRun.objects.create(account=account, job="exports.build", queue="exports", ref="late",
                           started_at=started, finished_at=started, outcome=Outcome.SUCCEEDED,
                           cpu_ms=5, wall_ms=7, items=11)

    run_job("scheduling.rollup_task_runs")

    after = TaskRunDaily.objects.get(pk=before.pk)
    assert (after.runs, after.cpu_ms, after.wall_ms, after.items) == (
        before.runs + 1, before.cpu_ms + 5, before.wall_ms + 7, before.items + 11)


# --- Pruning django-q2's rows and worker heartbeats ------------------------------------------

def test_prune_deletes_old_django_q_tasks_and_stale_heartbeats(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "DJANGO_Q_RETENTION_DAYS": 7}
    now = timezone.now()

    def task(name: str, days_ago: float, success: bool) -> Task:
        at = now - dt.timedelta(days=days_ago)
        return Task.objects.create(id=name, name=name, func="scheduling.runtime.execute", started=at, stopped=at,
                                   success=success)

    old = [task("old-failure", 30, False), task("old-success", 8, True)]
    fresh = [task("fresh-failure", 1, False), task("fresh-success", 0, True)]
    WorkerHeartbeat.objects.create(worker="gone:1", queue="default", seen_at=now - dt.timedelta(days=9))
    WorkerHeartbeat.objects.create(worker="gone:2", queue="exports", seen_at=now - dt.timedelta(days=8))
    WorkerHeartbeat.objects.create(worker="alive:3", queue="default", seen_at=now)
    WorkerHeartbeat.objects.create(worker="restarted:4", queue="exports", seen_at=now - dt.timedelta(hours=3))

    run = run_job("scheduling.prune_django_q")

    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, len(old) + 2)
    assert set(Task.objects.values_list("id", flat=True)) == {t.id for t in fresh}
    assert set(WorkerHeartbeat.objects.values_list("worker", flat=True)) == {"alive:3", "restarted:4"}

    again = run_job("scheduling.prune_django_q")
    assert (again.outcome, again.items) == (Outcome.SUCCEEDED, 0)
    assert Task.objects.count() == len(fresh) and WorkerHeartbeat.objects.count() == 2


# --- Reclaiming leases and releasing held work, as scheduled ---------------------------------

def test_release_deferred_job_releases_due_held_work_into_free_slots(
    account, other_account, django_capture_on_commit_callbacks,
):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=2)
    Budget.objects.create(account=other_account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    past, future = clock.now() - dt.timedelta(seconds=5), clock.now() + dt.timedelta(hours=1)
    for ref, acct, reason, eligible in [
        ("a1", account, DeferReason.RETRY_BACKOFF, past),
        ("a2", account, DeferReason.CONCURRENCY_CAP, past),
        ("a3", account, DeferReason.QUEUED_BEHIND, past),       # no third slot
        ("b1", other_account, DeferReason.BUDGET_EXHAUSTED, future),  # not yet due
    ]:
        hold(envelope=Envelope(job="tests.noop", account=acct.pk, ref=ref), queue="default", reason=reason,
             eligible_at=eligible)

    with django_capture_on_commit_callbacks(execute=True):
        run = run_job("scheduling.release_deferred")

    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, 2)
    assert queued_refs() == ["a1", "a2"]
    assert set(DeferredTask.objects.values_list("ref", flat=True)) == {"a3", "b1"}

    # Released jobs hold their slots from the broker on (until they start and settle), so the
    # next run releases nothing more: each held job goes out exactly once, and never past the cap.
    assert set(Reservation.objects.values_list("ref", "status")) == {
        ("a1", ReservationStatus.DISPATCHED), ("a2", ReservationStatus.DISPATCHED)}
    with django_capture_on_commit_callbacks(execute=True):
        assert run_job("scheduling.release_deferred").items == 0
    assert queued_refs() == ["a1", "a2"]


def test_reclaim_leases_job_gives_back_dead_runs_slots(account, django_capture_on_commit_callbacks):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=1)
    UsageDay.objects.create(account=account, queue="default", day=clock.budget_day(), cpu_reserved_ms=300)
    dead_run = TaskRun.objects.create(account=account, job="tests.noop", ref="dead", started_at=timezone.now())
    Reservation.objects.create(
        account=account, queue="default", day=clock.budget_day(), job="tests.noop", ref="dead",
        task_run=dead_run, cpu_reserved_ms=300, cpu_reported_ms=120,
        lease_expires_at=timezone.now() - dt.timedelta(seconds=1),
    )
    hold(envelope=Envelope(job="tests.noop", account=account.pk, ref="waiting"), queue="default",
         reason=DeferReason.CONCURRENCY_CAP, eligible_at=clock.now())

    with django_capture_on_commit_callbacks(execute=True):
        run = run_job("scheduling.reclaim_leases")

    assert (run.outcome, run.items) == (Outcome.SUCCEEDED, 1)
    dead_run.refresh_from_db()
    assert dead_run.outcome == Outcome.LOST
    assert Reservation.objects.get(ref="dead").status == ReservationStatus.RECLAIMED
    usage = UsageDay.objects.get(account=account, queue="default")
    assert (usage.cpu_used_ms, usage.cpu_reserved_ms) == (120, 0)
    assert queued_refs() == ["waiting"]

    with django_capture_on_commit_callbacks(execute=True):
        assert run_job("scheduling.reclaim_leases").items == 0
    usage.refresh_from_db()
    assert (usage.cpu_used_ms, usage.cpu_reserved_ms) == (120, 0)
    assert queued_refs() == ["waiting"]
