"""Django tasks (`@task`) for the tests, as a host application writes them. Workers import this
module by the task paths stored in the calls (modelled on django-tasks' own tests/tasks.py)."""
import asyncio
import os
import time

from django.db.models import F

from budgets.limits import BudgetExhausted
from budgets.models import Account, UsageDay
from scheduling import testing
from tasks.compat import TaskContext, task, task_finished, task_started


@task()
def noop(*args, **kwargs) -> None:
    return None


@task()
def meaning_of_life() -> int:
    return 42


@task()
def echo(*args, **kwargs) -> dict:
    return {"args": list(args), "kwargs": kwargs}


@task()
def whose(account: int, label: str) -> str:
    """Receives its account's id in `account` (it asks for it by name)."""
    return f"{label} for {Account.objects.get(pk=account).slug}"


@task()
def failing_value_error() -> None:
    raise ValueError("This task failed due to ValueError")


@task()
def failing_with_secret() -> None:
    raise RuntimeError("could not connect to postgres://app:Dsn-pa55word@db.internal:5432/prod for planted.person@example.com")


@task()
def flaky() -> None:
    raise ConnectionError("the upstream dropped the connection")  # transient: retried after a back-off


@task()
def stopped_by_the_cap(account: int) -> None:
    """Spends the rest of its account's day (as the ledger has it), then stops as the CPU hard cap
    stops a run that spent it."""
    UsageDay.objects.filter(account_id=account, queue="default").update(cpu_used_ms=F("cpu_used_ms") + 10**9)
    raise BudgetExhausted("the account's daily CPU budget is spent")


@task()
def failing_system_exit() -> None:
    raise SystemExit("This task failed due to SystemExit")


@task()
def exit_task() -> None:
    exit(1)


@task()
def complex_return_value():
    return lambda: True  # neither JSON nor anything else storable


@task()
def huge_return_value() -> str:
    return "x" * (10 * 1024 * 1024)


@task()
def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@task()
async def async_meaning(delay: float = 0.0) -> int:
    await asyncio.sleep(delay)
    return 42


@task()
async def async_account_slug(account: int) -> str:
    return (await Account.objects.aget(pk=account)).slug


@task(takes_context=True)
def get_context(context: TaskContext) -> dict:
    return {"id": context.task_result.id, "attempt": context.attempt, "workers": context.task_result.worker_ids}


@task(takes_context=True)
def sleep_on_first_attempt(context: TaskContext, seconds: float) -> str:
    """Long the first time (long enough to be killed in), quick when it is run again."""
    if context.attempt == 1:
        time.sleep(seconds)
    return f"attempt {context.attempt}"


@task(takes_context=True)
def superseded(context: TaskContext) -> str:
    """As if the reconciler gave the call to another run while this one ran (it thought it lost)."""
    from tasks.models import TaskCall

    TaskCall.objects.filter(pk=context.task_result.id).update(run=None)
    return "too late"


@task(queue_name="exports")
def on_exports() -> str:
    return "exports"


@task()
def system_chore() -> str:
    """Listed in the tests' SYSTEM_TASKS: runs for no account."""
    return "chore done"


# --- Signals in a worker (tests/tasks/test_worker.py) -----------------------------------------------
# A worker started with FAIRSHARE_TEST_SIGNAL_LOG appends one line per signal to that file.

def _log_signal(name):
    def receiver(sender, task_result, **kwargs):
        path = os.environ.get(testing.TEST_SIGNAL_LOG.env)
        if path:
            with open(path, "a") as log:
                log.write(f"{name} {task_result.id} {task_result.status} {sender.__name__}\n")
    return receiver


_on_started, _on_finished = _log_signal("started"), _log_signal("finished")
task_started.connect(_on_started, dispatch_uid="tests.tasks.started")
task_finished.connect(_on_finished, dispatch_uid="tests.tasks.finished")
