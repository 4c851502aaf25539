"""The kernel's settings invariants are system checks; an Error stops `qcluster` from starting."""
import subprocess
import sys

import pytest
from django.core.checks import run_checks

from tests.conftest import REPO, fairshare_checks, worker_env


def _exports_cluster(settings, **options):
    alt = settings.Q_CLUSTER["ALT_CLUSTERS"]
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "ALT_CLUSTERS": {**alt, "exports": {**alt["exports"], **options}}}


def test_the_default_settings_pass_every_check():
    assert fairshare_checks() == []
    assert [m for m in run_checks() if m.is_serious()] == []


def test_an_exports_retry_not_above_its_timeout_is_refused(settings):
    _exports_cluster(settings, timeout=1800, retry=1800)
    assert fairshare_checks() == [
        ("scheduling.E001", 'Q_CLUSTER cluster "exports": retry (1800 s) must be larger than timeout (1800 s).')]


def test_the_default_cluster_retry_must_exceed_its_timeout_too(settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "timeout": 300, "retry": 200}
    assert fairshare_checks() == [
        ("scheduling.E001", 'Q_CLUSTER cluster "default": retry (200 s) must be larger than timeout (300 s).')]


def test_a_queue_without_a_cluster_is_refused(settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "ALT_CLUSTERS": {}}
    assert fairshare_checks() == [("scheduling.E002", 'No Q_CLUSTER cluster serves the "exports" queue.')]


def test_healthz_must_outwait_a_workers_heartbeat(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "WORKER_HEARTBEAT_S": 10, "RELEASE_POLL_S": 1,
                          "HEALTH_HEARTBEAT_MAX_AGE_S": 11}
    assert fairshare_checks() == [(
        "scheduling.E003",
        'FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"] (11 s) must be larger than WORKER_HEARTBEAT_S + '
        'RELEASE_POLL_S (11 s).')]


def test_turning_the_pulse_off_is_a_warning(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "RELEASE_POLL_S": 0}
    assert fairshare_checks() == [("scheduling.W001", 'FAIRSHARE["RELEASE_POLL_S"] is 0: workers run no pulse.')]
    assert not any(m.is_serious() for m in run_checks(tags=["fairshare"]))


def test_the_stall_threshold_must_outwait_a_broker_poll(settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "poll": 2}
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 2}
    assert fairshare_checks() == [
        ("scheduling.E005", 'FAIRSHARE["QUEUE_STALL_AFTER_S"] (2 s) must be larger than the slowest queue\'s poll (2 s).')]


@pytest.mark.parametrize(("exit_after", "refused"), [(180, False), (0, False), (120, True)])
def test_a_stuck_pool_ends_itself_only_after_healthz_has_said_so(settings, exit_after, refused):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "QUEUE_STALL_AFTER_S": 120, "STALLED_POOL_EXIT_AFTER_S": exit_after}
    assert fairshare_checks() == ([(
        "scheduling.E009",
        'FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"] (120 s) must be larger than FAIRSHARE["QUEUE_STALL_AFTER_S"] (120 s), '
        "or 0.")] if refused else [])


def test_metrics_networks_must_be_networks(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "METRICS_ALLOWED_NETWORKS": "10.0.0.0/8, nope"}
    assert fairshare_checks() == [
        ("scheduling.E004", "FAIRSHARE[\"METRICS_ALLOWED_NETWORKS\"]: 'nope' is not a network.")]


@pytest.mark.processes
def test_qcluster_refuses_to_start_while_a_check_fails(export_root):
    """django-q2's qcluster command runs Django's system checks before starting any worker."""
    env = worker_env(export_root, Q_CLUSTER_NAME="exports", FAIRSHARE_EXPORT_TIMEOUT="30",
                     FAIRSHARE_EXPORT_RETRY="30", FAIRSHARE_EXPORT_ATTEMPT_DEADLINE="20")

    done = subprocess.run([sys.executable, "manage.py", "qcluster"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)

    assert done.returncode == 1
    assert ('(scheduling.E001) Q_CLUSTER cluster "exports": retry (30 s) must be larger than timeout (30 s).'
            in done.stderr), done.stderr
    assert "starting" not in (done.stdout + done.stderr).lower()


@pytest.mark.parametrize(("idle", "lock", "statement", "refused"), [
    (60, 120, 0, None),
    (60, 60, 0, "FAIRSHARE_DB_LOCK_TIMEOUT_S (60 s) must be larger than FAIRSHARE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S (60 s)."),
    (60, 120, 100, "FAIRSHARE_DB_STATEMENT_TIMEOUT_S (100 s) must be larger than FAIRSHARE_DB_LOCK_TIMEOUT_S (120 s), "
                   "or 0."),
    (0, 10, 0, None),  # the server's or the role's idle timeout: nothing to compare with
])
def test_a_frozen_lock_holder_must_be_cut_off_before_its_waiters_give_up(settings, idle, lock, statement, refused):
    settings.DATABASE_SESSION_TIMEOUTS_S = {"idle_in_transaction_session_timeout": idle, "lock_timeout": lock,
                                            "statement_timeout": statement}
    assert fairshare_checks() == ([("scheduling.E008", refused)] if refused else [])


def test_every_connection_carries_the_session_timeouts(db):
    from django.db import connection

    with connection.cursor() as cursor:
        shown = {}
        for name in ("idle_in_transaction_session_timeout", "lock_timeout", "statement_timeout"):
            cursor.execute(f"SHOW {name}")
            shown[name] = cursor.fetchone()[0]
    assert shown == {"idle_in_transaction_session_timeout": "1min", "lock_timeout": "2min", "statement_timeout": "0"}
