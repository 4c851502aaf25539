"""Fairshare as a Django Tasks backend (DEP 14: `django.tasks`, or the `django-tasks` backport).

    TASKS = {"default": {
        "BACKEND": "tasks.backend.FairshareBackend",
        "QUEUES": ["default", "exports"],            # Fairshare queues (django-q2 clusters)
        "OPTIONS": {"ACCOUNT_KWARG": "account",      # the keyword that names a call's account
                    "SYSTEM_TASKS": []},             # module paths of tasks that belong to no account
    }}

A call is stored (tasks.models.TaskCall: arguments and, later, the return value and errors, as
JSON) and sent through the kernel like any job (scheduling.runtime.enqueue), so budgets, caps, the
holding area, hand-off, retries, pause and metering apply to it; the broker's message names only
the call. How a call names its account: tasks/accounts.py. How it runs: tasks/execution.py.
"""
import uuid
from collections.abc import Iterable

from tasks import accounts, checks, payload, results, services, signals
from tasks.compat import BaseTaskBackend, InvalidTask, TaskResult, TaskResultDoesNotExist
from tasks.models import TaskCall

DEFAULT_ACCOUNT_KWARG = "account"


class FairshareBackend(BaseTaskBackend):
    supports_defer = True  # run_after: the call waits in the holding area until then
    supports_priority = True  # the order of an account's waiting work; fair share decides between accounts
    supports_async_task = True  # `async def` tasks run on an event loop of their own (tasks/execution.py)
    supports_get_result = True  # from any process: the call is a row

    def __init__(self, alias: str, params: dict):
        super().__init__(alias, params)
        self.options = params.get("OPTIONS", {})
        self.account_kwarg = self.options.get("ACCOUNT_KWARG", DEFAULT_ACCOUNT_KWARG)
        self.system_tasks = frozenset(self.options.get("SYSTEM_TASKS", ()))

    def validate_task(self, task) -> None:
        """The framework's checks, and a queue: every Fairshare job belongs to one (`check()` says
        which QUEUES are Fairshare's)."""
        super().validate_task(task)
        if not self.queues:
            raise InvalidTask(f"the {self.alias!r} tasks backend lists no QUEUES; every Fairshare task runs on a "
                              "Fairshare queue (default, exports)")

    def is_system_task(self, task) -> bool:
        return task.module_path in self.system_tasks

    def enqueue(self, task, args, kwargs) -> TaskResult:
        """Store the call and send it. Refused with a clear error (`CallRefused`, nothing stored or
        sent) when its account is missing, unknown or inactive, or its arguments are not JSON or
        too large."""
        self.validate_task(task)
        kwargs = dict(kwargs)
        account_id = accounts.account_of_call(task=task, kwargs=kwargs, name=self.account_kwarg,
                                              system=self.is_system_task(task))
        call = services.call_enqueue(backend=self.alias, task=task, account_id=account_id,
                                     arguments=payload.arguments(args, kwargs))
        result = results.to_result(call, task)
        signals.enqueued(result)
        return result

    def get_result(self, result_id: str) -> TaskResult:
        return results.to_result(_get(TaskCall.objects.filter(pk=_call_id(result_id)).first(), result_id))

    async def aget_result(self, result_id: str) -> TaskResult:
        return results.to_result(_get(await TaskCall.objects.filter(pk=_call_id(result_id)).afirst(), result_id))

    def check(self, **kwargs) -> Iterable:
        yield from super().check(**kwargs)
        yield from checks.backend_problems(self)


def _call_id(result_id) -> uuid.UUID:
    """A result id is a call's UUID; anything else names no result."""
    try:
        return uuid.UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None


def _get(call: TaskCall | None, result_id) -> TaskCall:
    if call is None:
        raise TaskResultDoesNotExist(result_id)
    return call
