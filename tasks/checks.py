"""System checks of a Fairshare Tasks backend: its `check()` (which the framework's own system
check calls for every TASKS backend) reports these, so `manage.py check`, `migrate`, `runserver`
and `qcluster` refuse to start while an error stands."""
from django.apps import apps
from django.conf import settings
from django.core import checks
from django.utils.module_loading import import_string

from scheduling.conf import clusters
from scheduling.registry import UnknownJob, get_job
from tasks import routing
from tasks.compat import Task
from tasks.conf import BACKEND_OPTIONS

LIMITS = ("TASKS_MAX_ARGS_BYTES", "TASKS_MAX_RESULT_BYTES", "TASKS_RESULT_RETENTION_DAYS", "TASKS_STALE_AFTER_S")


def backend_problems(backend) -> list[checks.CheckMessage]:
    where = f'TASKS["{backend.alias}"]'
    return [*_app(), *_queues(backend, where), *_options(backend, where), *_limits()]


def _app() -> list[checks.CheckMessage]:
    if apps.is_installed("tasks"):
        return []
    return [checks.Error("tasks.backend.FairshareBackend is configured but the tasks app is not installed.",
                         hint='Add "tasks" to INSTALLED_APPS: the calls are stored in its table.', id="tasks.E001")]


def _queues(backend, where: str) -> list[checks.CheckMessage]:
    if not backend.queues:
        return [checks.Error(f'{where}["QUEUES"] is empty.', id="tasks.E002",
                             hint="List the Fairshare queues its tasks may use (e.g. default, exports): every "
                                  "task runs on a queue's workers and budgets.")]
    known = clusters(settings.Q_CLUSTER)
    problems = []
    for queue in sorted(backend.queues):
        if queue not in known:
            problems.append(checks.Error(
                f'{where}["QUEUES"] names {queue!r}, which is not a Fairshare queue (no Q_CLUSTER cluster).',
                hint=f"Use one of {', '.join(sorted(known))}, or add a cluster for it.", id="tasks.E003"))
            continue
        for system in (False, True):
            try:
                get_job(routing.job_name(queue=queue, system=system))
            except UnknownJob:
                problems.append(checks.Error(
                    f"no job carries {where}'s tasks on the {queue!r} queue.", id="tasks.E004",
                    hint="The jobs are made from TASKS at start-up (tasks/jobs.py): restart the process."))
                break
    return problems


def _options(backend, where: str) -> list[checks.CheckMessage]:
    problems = []
    if unknown := sorted(set(backend.options) - BACKEND_OPTIONS):
        # A misspelt option would silently do nothing.
        problems.append(checks.Error(f'{where}["OPTIONS"] has unknown keys {unknown}.', id="tasks.E005",
                                     hint=f"Known: {', '.join(sorted(BACKEND_OPTIONS))}."))
    name = backend.account_kwarg
    if not isinstance(name, str) or not name.isidentifier():
        problems.append(checks.Error(f'{where}["OPTIONS"]["ACCOUNT_KWARG"] must be a keyword name, got {name!r}.',
                                     id="tasks.E006"))
    system = backend.options.get("SYSTEM_TASKS", [])
    if isinstance(system, str) or not all(isinstance(path, str) for path in system):
        problems.append(checks.Error(f'{where}["OPTIONS"]["SYSTEM_TASKS"] must be a list of module paths.',
                                     id="tasks.E007"))
        return problems
    for path in system:
        try:
            is_task = isinstance(import_string(path), Task)
        except ImportError:
            is_task = False
        if not is_task:
            problems.append(checks.Warning(f'{where}["OPTIONS"]["SYSTEM_TASKS"] lists {path!r}, which is not a task.',
                                           hint="A module path of a @task function, e.g. myapp.tasks.nightly.",
                                           id="tasks.W001"))
    return problems


def _limits() -> list[checks.CheckMessage]:
    return [checks.Error(f'FAIRSHARE["{key}"] must be above 0, got {settings.FAIRSHARE[key]!r}.', id="tasks.E008")
            for key in LIMITS if not settings.FAIRSHARE[key] > 0]
