"""The RLIMIT_CPU backstop's signal handling (in-process; the real limit is exercised by
tests/budgets/test_processes.py)."""
import os
import resource
import signal
import time

import pytest

from budgets.limits import BudgetExhausted, RunBudget, cpu_limit


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_an_early_sigxcpu_does_not_stop_a_run_with_allowance_left():
    # The kernel samples CPU time coarsely and can signal before the allowance is really spent.
    before = resource.getrlimit(resource.RLIMIT_CPU)
    with cpu_limit(RunBudget(60_000)):
        os.kill(os.getpid(), signal.SIGXCPU)
        _spin(0.01)
    assert resource.getrlimit(resource.RLIMIT_CPU) == before


def test_sigxcpu_once_the_allowance_is_spent_stops_the_run():
    before = resource.getrlimit(resource.RLIMIT_CPU)
    with pytest.raises(BudgetExhausted):
        with cpu_limit(RunBudget(5)):
            _spin(0.02)
            os.kill(os.getpid(), signal.SIGXCPU)
            _spin(0.01)
    assert resource.getrlimit(resource.RLIMIT_CPU) == before


def test_a_grown_allowance_raises_the_cpu_limit_and_is_restored_afterwards():
    before = resource.getrlimit(resource.RLIMIT_CPU)
    budget = RunBudget(1000)
    with cpu_limit(budget):
        soft = resource.getrlimit(resource.RLIMIT_CPU)[0]
        budget.grow(5000)
        assert resource.getrlimit(resource.RLIMIT_CPU)[0] == soft + 5
    assert resource.getrlimit(resource.RLIMIT_CPU) == before


def test_a_spent_allowance_asks_for_a_refill_before_it_stops_the_run():
    asked = []

    def refill():
        asked.append(budget.used_ms())
        if len(asked) == 1:
            budget.grow(50)

    budget = RunBudget(5, refill=refill)
    _spin(0.01)
    budget.check()  # refilled: goes on
    assert len(asked) == 1
    _spin(0.06)
    with pytest.raises(BudgetExhausted):
        budget.check()  # no more to be had
    assert len(asked) == 2
    budget.exhausted = True
    with pytest.raises(BudgetExhausted):
        budget.check()
    assert len(asked) == 2  # known to be exhausted: no more asking


def test_a_finished_run_is_not_stopped_by_a_late_signal():
    budget = RunBudget(1)
    _spin(0.01)  # spent
    budget.finished = True
    with cpu_limit(budget):
        os.kill(os.getpid(), signal.SIGXCPU)
        _spin(0.01)
