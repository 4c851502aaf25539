"""Which Fairshare job carries a Django task call. A Fairshare job has one queue and is either an
account's work or system work, so each queue a Fairshare `TASKS` backend lists has two jobs:
`tasks.run.<queue>` (an account's calls: admission, budgets, caps, fair share) and
`tasks.system.<queue>` (calls of the backend's SYSTEM_TASKS, which belong to no account)."""
from django.conf import settings
from django.utils.module_loading import import_string

BACKEND_PATH = "tasks.backend.FairshareBackend"


def job_name(*, queue: str, system: bool) -> str:
    return f"tasks.system.{queue}" if system else f"tasks.run.{queue}"


def fairshare_backends() -> dict[str, dict]:
    """The TASKS entries (alias: params) whose backend is Fairshare's (or a subclass of it)."""
    from tasks.backend import FairshareBackend

    found = {}
    for alias, params in getattr(settings, "TASKS", {}).items():
        try:
            backend = import_string(params["BACKEND"])
        except (ImportError, KeyError):
            continue  # the framework reports a backend it cannot load
        if isinstance(backend, type) and issubclass(backend, FairshareBackend):
            found[alias] = params
    return found


def queues() -> list[str]:
    """Every queue a Fairshare backend lists, in order, once."""
    seen: dict[str, None] = {}
    for params in fairshare_backends().values():
        seen.update(dict.fromkeys(params.get("QUEUES", [])))
    return list(seen)
