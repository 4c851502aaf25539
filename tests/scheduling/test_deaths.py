"""A dead pool worker's sessions (scheduling.deaths): its sentinel gives back what the worker held
only once none of them is left, waiting for them, then ending those still there. The whole path,
with real pools whose workers are SIGKILLed: tests/scheduling/test_pool.py."""
import psycopg
import pytest
from django.conf import settings

from scheduling import deaths

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
