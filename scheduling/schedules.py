"""Cron schedules declared in code, synced into django-q2 `Schedule` rows by `sync_schedules`.

Each schedule fires a registered job through the same runner and middleware chain as on-demand
work. Rows are matched by name (prefixed "fairshare:"); a declaration removed from code removes
its row.
"""
from dataclasses import dataclass

from croniter import croniter
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from django_q.models import Schedule

from scheduling.envelope import Envelope
from scheduling.registry import get_job
from scheduling.broker import RUNNER

PREFIX = "fairshare:"


@dataclass(frozen=True)
class CronSchedule:
    name: str
    job: str
    cron: str

    def envelope(self) -> Envelope:
        # The version producers send (stored in the row: `sync_schedules` after changing it).
        return Envelope(job=self.job, account=None, ref=f"schedule:{self.name}",
                        v=settings.FAIRSHARE["ENVELOPE_VERSION"])


SCHEDULES: tuple[CronSchedule, ...] = (
    CronSchedule("release-deferred", "scheduling.release_deferred", "* * * * *"),
    CronSchedule("reclaim-leases", "scheduling.reclaim_leases", "* * * * *"),
    CronSchedule("sweep-lost-runs", "scheduling.sweep_lost_runs", "* * * * *"),
    CronSchedule("reconcile-exports", "exports.reconcile", "* * * * *"),
    CronSchedule("recurring-exports", "exports.run_schedules", "* * * * *"),
    CronSchedule("reconcile-task-calls", "tasks.reconcile", "* * * * *"),
    CronSchedule("purge-expired-exports", "exports.purge_expired", "17 * * * *"),
    CronSchedule("prune-task-results", "tasks.prune_results", "29 * * * *"),
    CronSchedule("end-budget-adjustments", "budgets.end_adjustments", "1 * * * *"),
    CronSchedule("rollup-task-runs", "scheduling.rollup_task_runs", "23 3 * * *"),
    CronSchedule("prune-django-q", "scheduling.prune_django_q", "41 3 * * *"),
)


@transaction.atomic
def sync_schedules(declared: tuple[CronSchedule, ...] = SCHEDULES) -> dict[str, int]:
    """Create, update and delete Schedule rows to match `declared`; idempotent."""
    counts = {"created": 0, "updated": 0, "deleted": 0, "unchanged": 0}
    now = timezone.now()
    for spec in declared:
        queue = get_job(spec.job).queue
        wanted = {
            "func": RUNNER, "args": repr(spec.envelope().to_message()), "kwargs": None,
            "schedule_type": Schedule.CRON, "cron": spec.cron, "repeats": -1,
            "cluster": None if queue == "default" else queue,
        }
        row = Schedule.objects.select_for_update().filter(name=PREFIX + spec.name).first()
        if row is None:
            Schedule.objects.create(name=PREFIX + spec.name, next_run=croniter(spec.cron, now).get_next(type(now)), **wanted)
            counts["created"] += 1
            continue
        changed = {k: v for k, v in wanted.items() if getattr(row, k) != v}
        if not changed:
            counts["unchanged"] += 1
            continue
        if "cron" in changed:
            # django-q2 does not recompute next_run when a cron expression changes.
            changed["next_run"] = croniter(spec.cron, now).get_next(type(now))
        Schedule.objects.filter(pk=row.pk).update(**changed)
        counts["updated"] += 1
    names = [PREFIX + s.name for s in declared]
    counts["deleted"], _ = Schedule.objects.filter(name__startswith=PREFIX).exclude(name__in=names).delete()
    return counts
