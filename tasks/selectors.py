"""Reads of the tasks app. (The admin scopes calls per account itself: budgets.tenancy.)"""
from scheduling.models import DeferredTask
from scheduling.selectors import with_their_line
from tasks import routing


def holds_of(calls) -> dict[str, DeferredTask]:
    """Why each READY call that waits in the holding area waits (its DeferredTask, by call id), in
    one query: the holding area keys held work by job and ref, a call's ref is its id."""
    ready = [c for c in calls if c.status == "READY"]
    if not ready:
        return {}
    jobs = {routing.job_name(queue=c.queue, system=c.account_id is None) for c in ready}
    # A job in its account's line waits for a slot, or with its line (its Backlog row), as the
    # holding area's own admin reads it.
    held = with_their_line(DeferredTask.objects.filter(job__in=jobs, ref__in=[str(c.pk) for c in ready]))
    return {row.ref: row for row in held}
