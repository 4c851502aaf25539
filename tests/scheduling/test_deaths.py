"""A dead pool worker's sessions (scheduling.deaths): its sentinel gives back what the worker held
only once none of them is left, waiting for them, then ending those still there. The whole path,
with real pools whose workers are SIGKILLed: tests/scheduling/test_pool.py."""
import json
import subprocess
import sys

import psycopg
import pytest
from django.conf import settings

from scheduling import deaths
from scheduling.processes import worker_env
from tests.conftest import REPO

pytestmark = pytest.mark.django_db(transaction=True)  # each look at pg_stat_activity its own transaction


def session_of(worker: str) -> psycopg.Connection:
    """A session named as `worker`'s are (a stand-in for one its backend still runs)."""
    db = settings.DATABASES["default"]
    return psycopg.connect(dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"] or None,
                           host=db["HOST"] or None, port=db["PORT"] or None, autocommit=True,
                           application_name=deaths.session_name(worker))


def test_a_worker_with_no_session_left_is_judged_at_once():
    assert deaths.sessions_ended("vm:4242")


def test_a_session_still_there_is_waited_for_then_ended(monkeypatch):
    monkeypatch.setattr(deaths, "SESSIONS_END_WITHIN_S", 0.3)
    lingering = session_of("vm:4243")
    try:
        assert deaths._sessions(deaths.session_name("vm:4243")) == 1
        assert deaths.sessions_ended("vm:4243")  # ended (pg_terminate_backend) after the wait
        with pytest.raises(psycopg.OperationalError):
            lingering.execute("SELECT 1")
    finally:
        lingering.close()


def test_a_session_name_keeps_the_pid_whatever_the_host_name():
    name = deaths.session_name(f"{'h' * 80}:123456")
    assert len(name.encode()) <= 63 and name.startswith("fairshare worker 123456@")


# A worker's death judged in a fresh sentinel-like process: what did judging it import after
# `prepare`? Printed as one JSON list.
JUDGE_A_DEATH = """
import json, sys, django
django.setup()
from scheduling import deaths
from scheduling.broker import RUNNER
{prepare}
loaded = set(sys.modules)
task = {{"func": RUNNER, "args": ({{"job": "exports.build", "ref": "1"}},)}}
deaths.after_death(task, worker="vm:4244", hand_on=lambda task, why: None, hand_in=lambda task: None)
print(json.dumps(sorted(set(sys.modules) - loaded)))
"""


def _imported_by_a_death(*, prepared: bool) -> list[str]:
    code = JUDGE_A_DEATH.format(prepare="deaths.prepare()" if prepared else "")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=worker_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_a_sentinel_prepared_before_its_first_fork_imports_nothing_when_a_worker_dies():
    # A module one of the sentinel's threads imports while the sentinel forks stays half-initialized
    # in the child: a new worker's every pulse then failed with ImportError (seen in CI).
    assert "budgets.gate" in _imported_by_a_death(prepared=False)  # what the first death used to load
    assert _imported_by_a_death(prepared=True) == []
