"""The one process control for qcluster workers (tests, bench/ and rehearse): what a worker is
given, so that it works on the same database as the process that started it."""
import os

import dj_database_url
import pytest
from django.db import connection

from scheduling import processes


def test_a_workers_database_url_keeps_credentials_with_url_characters_intact(monkeypatch):
    for key, value in {"USER": "app@tenant", "PASSWORD": "p@ss/w:rd?#%", "NAME": "fair share",
                       "HOST": "db.internal", "PORT": "6543"}.items():
        monkeypatch.setitem(connection.settings_dict, key, value)

    parsed = dj_database_url.parse(processes.database_url())

    assert (parsed["USER"], parsed["PASSWORD"], parsed["NAME"], parsed["HOST"], parsed["PORT"]) == (
        "app@tenant", "p@ss/w:rd?#%", "fair share", "db.internal", 6543)


def test_a_workers_environment_is_this_processs_with_its_queue_left_to_the_cluster(monkeypatch):
    monkeypatch.setenv("Q_CLUSTER_NAME", "exports")
    monkeypatch.setenv("REDIS_URL", "redis://cache:6379/0")
    monkeypatch.setenv("FAIRSHARE_SOMETHING", "inherited")

    env = processes.worker_env(without={"REDIS_URL"}, FAIRSHARE_POLL="0.1")

    assert "Q_CLUSTER_NAME" not in env and "REDIS_URL" not in env
    assert env["FAIRSHARE_SOMETHING"] == "inherited" and env["FAIRSHARE_POLL"] == "0.1"
    assert env["DATABASE_URL"] == processes.database_url()


@pytest.mark.django_db
def test_a_worker_started_by_a_test_uses_that_tests_database_also_beside_other_pytest_xdist_workers(monkeypatch):
    """pytest-django gives each xdist worker its own test database (test_<name>_gw0, _gw1, ...);
    the DATABASE_URL in the environment names the base database, so a worker must not take it from
    there: its URL names the database this test runs in."""
    monkeypatch.setenv("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/the-base-database")
    with connection.cursor() as cursor:
        cursor.execute("SELECT current_database()")
        (current,) = cursor.fetchone()

    env = processes.worker_env()

    assert dj_database_url.parse(env["DATABASE_URL"])["NAME"] == current
    if worker := os.environ.get("PYTEST_XDIST_WORKER"):
        assert current.endswith(f"_{worker}")
