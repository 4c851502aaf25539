"""The bare baseline of bench/budget_overhead.py: a django-q2 task function that does nothing.

Workers import it as `bench.noop.noop` (manage.py's folder, the repository, is on their path).
"""


def noop(*args, **kwargs) -> None:
    pass
