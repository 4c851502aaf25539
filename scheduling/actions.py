"""Operator actions on the kernel's records: release held work, run a schedule now.

Each returns per-item results (scheduling.operator.ItemResult), checks the role and writes the
admin log; the admin and the commands call these, never the models directly.
"""
import ast

from django.db import transaction
from django_q.models import Schedule
from django_q.tasks import async_task

from scheduling import envelope as contract
from scheduling import holding
from scheduling.models import DeferredTask
from scheduling.operator import ItemResult, log_action, refusal
from scheduling.broker import RUNNER, send


def release_held(*, user, deferred_ids: list[int]) -> list[ItemResult]:
    """Send held work back to the queue now, whatever the reason it was held."""
    results = []
    for deferred_id in deferred_ids:
        with transaction.atomic():
            # Row lock: the pulse's automatic release and this one must not both send the job.
            task = DeferredTask.objects.select_for_update().filter(pk=deferred_id).first()
            why = "not found (already released?)" if task is None else refusal(
                user=user, account_id=task.account_id, needs="operator")
            if why:
                results.append(ItemResult(f"held task {deferred_id}", False, why))
                continue
            if not holding.release_now(deferred_ids=[task.pk]):
                # A message parked for a newer worker: this process does not speak its version.
                results.append(ItemResult(str(task), False, f"needs a worker that speaks envelope "
                                          f"v{task.envelope_version}: such a worker releases it when it runs"))
                continue
            log_action(user=user, obj=task, message=f"Released from the holding area (was: {task.get_reason_display()})")
            results.append(ItemResult(str(task), True, "released to the queue"))
    return results


def run_schedule_now(*, user, schedule_id: int) -> ItemResult:
    """Fire a django-q2 schedule once, now (Fairshare's own `fairshare:` ones included); its
    regular timetable is unchanged. Schedules belong to no account: superusers only."""
    why = refusal(user=user, account_id=None, needs="operator")
    with transaction.atomic():
        # Row lock: django-q2's scheduler locks the rows it fires; ours is not fired half-way
        # through its tick's update of next_run.
        schedule = Schedule.objects.select_for_update().filter(pk=schedule_id).first()
        if schedule is None:
            return ItemResult(f"schedule {schedule_id}", False, "not found")
        if why:
            return ItemResult(schedule.name or str(schedule.pk), False, why)
        args = ast.literal_eval(schedule.args) if schedule.args else ()
        args = args if isinstance(args, tuple) else (args,)  # as django-q2's scheduler reads them
        kwargs = ast.literal_eval(schedule.kwargs) if schedule.kwargs else {}
        if schedule.func == RUNNER:
            envelope = contract.parse(args[0])  # our own: through the one runner, like its cron fires
            transaction.on_commit(lambda: send(job=envelope.job, account=envelope.account, ref=envelope.ref))
        else:
            options = {"cluster": schedule.cluster} if schedule.cluster else {}
            transaction.on_commit(lambda: async_task(schedule.func, *args, **kwargs, **options))
        log_action(user=user, obj=schedule, message="Ran now")
    return ItemResult(schedule.name or str(schedule.pk), True, "sent to its queue")
