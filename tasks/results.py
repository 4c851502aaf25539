"""A stored call as the framework's TaskResult, and the Task it calls."""
import functools

from django.utils.module_loading import import_string

from tasks import accounts
from tasks.compat import Task, TaskError, TaskResult, TaskResultStatus
from tasks.exceptions import NotATask
from tasks.models import TaskCall


def task_of(call: TaskCall) -> Task:
    """The call's Task as it was enqueued (priority, queue, run_after, backend). ImportError when
    its module or function is gone; NotATask when the path names something else (a stored path is
    never trusted to be a Task: it is imported, not called, until it is checked)."""
    return _task(call.task_path, call.priority, call.queue, call.run_after, call.backend)


@functools.lru_cache(maxsize=1024)
def _task(path: str, priority: int, queue: str, run_after, backend: str) -> Task:
    """Tasks are immutable: one per shape, validated once (`using` asks the backend each time)."""
    task = import_string(path)
    if not isinstance(task, Task):
        raise NotATask(f"{path} is not a Task (a function decorated with @task)")
    return task.using(priority=priority, queue_name=queue, run_after=run_after, backend=backend)


def function_kwargs(call: TaskCall, task: Task) -> dict:
    """The keyword arguments the task's function receives for this call."""
    return accounts.call_kwargs(func=task.func, kwargs=call.arguments["kwargs"], account_id=call.account_id,
                                name=task.get_backend().account_kwarg)


def to_result(call: TaskCall, task: Task | None = None) -> TaskResult:
    """The framework's view of the call, as it is now."""
    task = task if task is not None else task_of(call)
    result = TaskResult(
        task=task, id=str(call.pk), status=TaskResultStatus(call.status), enqueued_at=call.enqueued_at,
        started_at=call.started_at, finished_at=call.finished_at, last_attempted_at=call.last_attempted_at,
        args=call.arguments["args"], kwargs=function_kwargs(call, task), backend=call.backend,
        errors=[TaskError(exception_class_path=e["exception_class_path"], traceback=e["traceback"])
                for e in call.errors],
        worker_ids=list(call.worker_ids),
    )
    object.__setattr__(result, "_return_value", call.return_value)  # the framework's own field
    return result
