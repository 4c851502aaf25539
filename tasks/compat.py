"""The Django Tasks framework, from wherever this install has it: `django.tasks` (Django 6 and
later) or its backport, the `django-tasks` package (`django_tasks`, Django 5.2). The one module of
Fairshare that imports either; everything else imports the framework's names from here.

The two agree on everything Fairshare uses except one name: the backport calls the exception for a
task a backend refuses `InvalidTaskError`, Django 6 calls it `InvalidTask`. Both are `InvalidTask`
here.
"""
try:
    from django.tasks import exceptions as _exceptions
    from django.tasks import default_task_backend, task, task_backends
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json
except ImportError:  # Django 5.2: the backport
    from django_tasks import exceptions as _exceptions
    from django_tasks import default_task_backend, task, task_backends
    from django_tasks.backends.base import BaseTaskBackend
    from django_tasks.base import Task, TaskContext, TaskError, TaskResult, TaskResultStatus
    from django_tasks.signals import task_enqueued, task_finished, task_started
    from django_tasks.utils import normalize_json

InvalidTask = getattr(_exceptions, "InvalidTask", None) or _exceptions.InvalidTaskError
TaskResultDoesNotExist = _exceptions.TaskResultDoesNotExist

__all__ = [
    "BaseTaskBackend", "InvalidTask", "Task", "TaskContext", "TaskError", "TaskResult", "TaskResultDoesNotExist",
    "TaskResultStatus", "default_task_backend", "normalize_json", "task", "task_backends", "task_enqueued",
    "task_finished", "task_started",
]
