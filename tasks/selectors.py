"""Reads of the tasks app shared by the admin and the ops metrics."""
from django.db.models import QuerySet

from budgets.tenancy import accounts_visible_to
from scheduling.models import DeferredTask
from tasks import routing
from tasks.models import TaskCall


def calls_visible_to(*, user) -> QuerySet[TaskCall]:
    """Calls of the accounts the user belongs to (any role); superusers see all, system calls too."""
    if user is None or not user.is_authenticated or not user.is_active:
        return TaskCall.objects.none()
    if user.is_superuser:
        return TaskCall.objects.all()
    return TaskCall.objects.filter(account__in=accounts_visible_to(user=user))


def holds_of(calls) -> dict[str, DeferredTask]:
    """Why each READY call that waits in the holding area waits (its DeferredTask, by call id), in
    one query: the holding area keys held work by job and ref, a call's ref is its id."""
    ready = [c for c in calls if c.status == "READY"]
    if not ready:
        return {}
    jobs = {routing.job_name(queue=c.queue, system=c.account_id is None) for c in ready}
    return {held.ref: held for held in DeferredTask.objects.filter(job__in=jobs, ref__in=[str(c.pk) for c in ready])}
