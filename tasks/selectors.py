"""Reads of the tasks app. (The admin scopes calls per account itself: budgets.tenancy.)"""
from scheduling.models import DeferredTask
from scheduling.waits import why_held
from tasks import routing


def holds_of(calls) -> dict[str, DeferredTask]:
    """Each READY call's held job, by call id, with what it waits for now (`.wait`): one query for the
    held rows (the holding area keys held work by job and ref, a call's ref is its id), and the
    explanations of their lines in one batch (scheduling.waits)."""
    ready = [c for c in calls if c.status == "READY"]
    if not ready:
        return {}
    jobs = {routing.job_name(queue=c.queue, system=c.account_id is None) for c in ready}
    held = list(DeferredTask.objects.filter(job__in=jobs, ref__in=[str(c.pk) for c in ready]))
    waits = why_held(held)
    for row in held:
        row.wait = waits[row.pk]
    return {row.ref: row for row in held}
