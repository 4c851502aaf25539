"""The tasks app's FAIRSHARE settings (see scheduling/conf.py for how apps declare them), and the
framework app config/settings.py installs.

Importable before Django is set up (config/settings.py imports it): no django.conf here, and no
import of the Tasks framework itself (tasks/compat.py does that, once Django is set up).
"""
from importlib.util import find_spec

from scheduling.conf import Setting, names

# The keys a Fairshare TASKS backend's OPTIONS may have (tasks/backend.py; a misspelt one is an
# error, tasks.E005, since it would do nothing).
BACKEND_OPTIONS = frozenset({"ACCOUNT_KWARG", "SYSTEM_TASKS"})

SETTINGS = (
    Setting("TASKS_MAX_ARGS_BYTES", "FAIRSHARE_TASKS_MAX_ARGS_BYTES", 64 * 1024, parse=int, unit="bytes",
            doc="largest a Django task call's arguments may be, as JSON; a bigger call is refused at "
                "`enqueue()` (`CallRefused`, code `arguments_too_large`) and nothing is stored or sent"),
    Setting("TASKS_MAX_RESULT_BYTES", "FAIRSHARE_TASKS_MAX_RESULT_BYTES", 64 * 1024, parse=int, unit="bytes",
            doc="largest a Django task's return value may be, as JSON; a bigger one fails the call "
                "(`ResultTooLarge`)"),
    Setting("TASKS_RESULT_RETENTION_DAYS", "FAIRSHARE_TASKS_RESULT_RETENTION_DAYS", 7, parse=int, unit="days",
            doc="days a finished Django task call (its arguments, result and errors) is kept before "
                "maintenance deletes it"),
    Setting("DOOR_TASKS", "FAIRSHARE_DOOR_TASKS", [], parse=names, shown_default="none",
            doc="module paths of the `@task` functions other services may call through the RabbitMQ door "
                "(comma-separated; docs/door.md); a message naming another is dead-lettered"),
    Setting("DOOR_MAX_BYTES", "FAIRSHARE_DOOR_MAX_BYTES", 128 * 1024, parse=int, unit="bytes",
            doc="largest message body the door accepts; a bigger one is dead-lettered unread"),
    Setting("TASKS_STALE_AFTER_S", "FAIRSHARE_TASKS_STALE_AFTER_S", 120, parse=int, unit="s",
            doc="the reconciler sends again a ready Django task call that nothing has held, sent or run "
                "for this long (its message was lost)"),
)


def framework_apps() -> list[str]:
    """The Tasks framework's app for INSTALLED_APPS: the backport's (its system checks and signal
    handlers) on Django 5.2; none on Django 6, where `django.tasks` is part of Django."""
    return [] if find_spec("django.tasks") is not None else ["django_tasks"]
