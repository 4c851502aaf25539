"""Fixtures and helpers of the Django Tasks backend's tests."""
import asyncio

import pytest
from asgiref.sync import sync_to_async
from django.db import connections
from django_q.models import OrmQ

from scheduling.models import DeferredTask
from scheduling.runtime import execute
from tasks.models import TaskCall


def envelope(result, *, job: str | None = None) -> dict:
    """The message a worker receives for a call (what the kernel sent: identifiers only)."""
    call = TaskCall.objects.get(pk=result.id)
    system = call.account_id is None
    return {"v": 1, "job": job or f"tasks.{'system' if system else 'run'}.{call.queue}", "account": call.account_id,
            "ref": str(call.pk)}


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
