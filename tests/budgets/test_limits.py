"""The RLIMIT_CPU backstop's signal handling (in-process; the real limit is exercised by
tests/budgets/test_processes.py)."""
import os
import resource
import signal
import time

import pytest

from budgets.limits import BudgetExhausted, cpu_limit


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_an_early_sigxcpu_does_not_stop_a_run_with_allowance_left():
    # The kernel samples CPU time coarsely and can signal before the allowance is really spent.
    before = resource.getrlimit(resource.RLIMIT_CPU)
    with cpu_limit(60_000):
        os.kill(os.getpid(), signal.SIGXCPU)
        _spin(0.01)
    assert resource.getrlimit(resource.RLIMIT_CPU) == before


def test_sigxcpu_once_the_allowance_is_spent_stops_the_run():
    before = resource.getrlimit(resource.RLIMIT_CPU)
    with pytest.raises(BudgetExhausted):
        with cpu_limit(5):
            _spin(0.02)
            os.kill(os.getpid(), signal.SIGXCPU)
            _spin(0.01)
    assert resource.getrlimit(resource.RLIMIT_CPU) == before
