"""The job registry: every kind of work Fairshare runs, with its queue and policies.

Jobs are declared next to their code with the `@job` decorator in `<app>/jobs.py`, which
`SchedulingConfig.ready()` imports.
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from scheduling.envelope import ContractError, check_priority
from scheduling.retries import RetryPolicy

if TYPE_CHECKING:
    from scheduling.context import TaskContext

Handler = Callable[["TaskContext"], None]


@dataclass(frozen=True)
class Job:
    name: str
    handler: Handler
    queue: str = "default"
    # Whether the envelope must name an account (every tenant's work does).
    account_scoped: bool = True
    # What admission reserves before the run; settlement charges what was measured.
    cpu_estimate_ms: int = 100
    retry: RetryPolicy = RetryPolicy()
    # Called once the job fails for good (terminal error, or out of attempts): `(ctx, exc)`.
    on_give_up: Callable[["TaskContext", BaseException], None] | None = None
    # The default priority of its work (-100 to 100): an account's higher-priority held work starts
    # first; `enqueue(priority=)` overrides it per call.
    priority: int = 0

    def __post_init__(self) -> None:
        check_priority(self.priority)


class UnknownJob(ContractError):
    pass


_jobs: dict[str, Job] = {}


def job(name: str, **options) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        if name in _jobs and _jobs[name].handler is not handler:
            raise ValueError(f"job {name!r} is registered twice")
        _jobs[name] = Job(name=name, handler=handler, **options)
        return handler

    return register


def get_job(name: str) -> Job:
    try:
        return _jobs[name]
    except KeyError:
        raise UnknownJob(f"unknown job {name!r}") from None
