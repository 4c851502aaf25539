"""The tasks app on /metrics: calls waiting and running per queue, and the oldest waiting one's
age; finished calls are the kernel's task-run families (per job)."""
import datetime as dt

import pytest
from django.utils import timezone

from tasks.compat import TaskResultStatus
from tasks.models import TaskCall
from tests.scheduling.test_ops_endpoints import by, scrape
from tests.tasks import functions as f

pytestmark = pytest.mark.django_db


def test_metrics_count_the_calls_waiting_and_running_per_queue(account, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True):
        ready, running, done = (f.noop.enqueue(account=account) for _ in range(3))
        f.on_exports.enqueue(account=account)
    TaskCall.objects.filter(pk=running.id).update(status=TaskResultStatus.RUNNING)
    TaskCall.objects.filter(pk=done.id).update(status=TaskResultStatus.SUCCESSFUL)
    TaskCall.objects.filter(pk=ready.id).update(enqueued_at=timezone.now() - dt.timedelta(minutes=5))

    samples = scrape()
    assert by(samples["fairshare_task_calls"], "queue", "status") == {
        ("default", "READY"): 1, ("default", "RUNNING"): 1, ("exports", "READY"): 1}
    oldest = by(samples["fairshare_task_calls_oldest_ready_seconds"], "queue")
    assert oldest[("default",)] >= 300 and oldest[("exports",)] < 300
