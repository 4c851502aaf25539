"""Fixtures and helpers of the Django Tasks backend's tests."""
import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django_q.models import OrmQ

from scheduling.envelope import Envelope
from scheduling.models import DeferredTask
from scheduling.runtime import execute
from tasks import routing
from tasks.models import TaskCall


def envelope(result) -> dict:
    """The message a worker receives for a call (what the kernel sends: identifiers only)."""
    call = TaskCall.objects.get(pk=result.id)
    job = routing.job_name(queue=call.queue, system=call.account_id is None)
    return Envelope(job=job, account=call.account_id, ref=str(call.pk), priority=call.priority).to_message()


def run_here(result) -> None:
    """Run a call's message in this process, through the whole chain, as a worker would."""
    execute(envelope(result))


def nothing_stored() -> bool:
    """No call, no message, nothing held: what a refused enqueue leaves."""
    return not TaskCall.objects.exists() and not OrmQ.objects.exists() and not DeferredTask.objects.exists()


@pytest.fixture
def close_async_connections():
    """An async task's ORM calls run on asgiref's thread, whose connection outlives the test: close
    it, so the test database can be dropped."""
    yield
    asyncio.run(sync_to_async(connections.close_all)())
