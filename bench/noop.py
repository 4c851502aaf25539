"""The bare baseline of bench/budget_overhead.py: a django-q2 task function that does nothing.

Not a Fairshare job (that is `scheduling.noop`, which the benchmark's other path runs): a job's
handler takes the chain's TaskContext, and the chain is what this baseline leaves out.
Workers import it as `bench.noop.noop` (manage.py's folder, the repository, is on their path).
"""


def noop(*args, **kwargs) -> None:
    pass
