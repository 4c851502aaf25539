"""The Django task of bench/tasks_overhead.py: a `@task` that does nothing, beside the kernel's
`scheduling.noop` job, so the two paths differ only by what the Tasks backend adds (the stored
call, its claim and its completion). Importable once Django is set up (`@task` asks the TASKS
backend to validate it); workers import it by the path stored in each call."""
from tasks.compat import task


@task()
def noop() -> None:
    return None
