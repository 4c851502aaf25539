"""What /metrics and /healthz report. Each app contributes from its own `ops.py`, imported at
start-up like `jobs.py`, so the kernel serves every app's figures without importing the apps
above it:

    # <app>/ops.py
    from scheduling import monitoring

    @monitoring.metrics
    def collect():                      # yields prometheus_client metric families
        yield GaugeMetricFamily("fairshare_…", "…", value=…)

    @monitoring.health_check("export_storage")
    def storage_writable() -> str | None:
        ...                             # None when fine, else what is wrong (no paths, no secrets)

A check may also return {part: problem or None}: one check per part, named "<name>:<part>".
Figures come from shared state (the database, the broker), never from per-process counters, so
any number of web and worker processes report one consistent picture.
"""
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import Metric

Problem = str | None
Check = Callable[[], Problem | dict[str, Problem]]

_collectors: dict[str, Callable[[], Iterable[Metric]]] = {}
_checks: dict[str, Check] = {}


def metrics(collect: Callable[[], Iterable[Metric]]) -> Callable[[], Iterable[Metric]]:
    _collectors[f"{collect.__module__}.{collect.__qualname__}"] = collect
    return collect


def health_check(name: str) -> Callable[[Check], Check]:
    def register(check: Check) -> Check:
        known = _checks.get(name)
        if known is not None and (known.__module__, known.__qualname__) != (check.__module__, check.__qualname__):
            raise ValueError(f"health check {name!r} is registered twice")
        _checks[name] = check
        return check

    return register


def collect_metrics() -> Iterator[Metric]:
    for collect in _collectors.values():
        yield from collect()


def run_health_checks() -> dict[str, Problem]:
    """{check name: None when fine, else the problem}, in registration order."""
    results: dict[str, Problem] = {}
    for name, check in _checks.items():
        try:
            result = check()
        except Exception as exc:  # a broken check must not take /healthz down with it
            result = f"unknown ({type(exc).__name__})"
        if isinstance(result, dict):
            results.update({f"{name}:{part}": problem for part, problem in result.items()})
        else:
            results[name] = result
    return results
