"""Operations endpoints: /metrics agrees with the database, /healthz names what is failing, and
the runner's log line is one JSON object without exception text."""
import datetime as dt
import json
import logging
import os
import socket
import subprocess
import sys
from collections import Counter, defaultdict

import pytest
from django.db import connection
from django.db.models import Count
from django.test import Client
from django.utils import timezone
from django_q.models import OrmQ
from prometheus_client.parser import text_string_to_metric_families

from budgets import clock
from budgets.models import Budget, UsageDay
from config.logging import JsonFormatter
from exports.models import ExportRecord, ExportStatus
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.registry import job
from scheduling.envelope import Envelope
from scheduling.holding import hold
from scheduling.runtime import execute, send
from scheduling.waits import why_held
from tests.conftest import REPO, wait_for

pytestmark = pytest.mark.django_db

SECRET_TEXT = "row of alice@example.com, password=hunter2, card 4111111111111111"


@job("tests.ops_leaky_failure", account_scoped=False)
def leaky_failure(ctx) -> None:
    """Fails with customer data in its exception message."""
    raise ValueError(SECRET_TEXT)


# --- /metrics ---------------------------------------------------------------------------------

def scrape(client: Client | None = None, **headers) -> dict[str, dict[tuple, float]]:
    response = (client or Client()).get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(response.content.decode()):
        for s in family.samples:
            samples[s.name][tuple(sorted(s.labels.items()))] = s.value
    return samples


def by(metric: dict[tuple, float], *label_names: str) -> dict[tuple, float]:
    """{(label values in the given order): value}."""
    return {tuple(dict(k)[n] for n in label_names): v for k, v in metric.items()}


@pytest.fixture
def busy_system(account, other_account):
    """A bit of everything /metrics reports, including figures that must not count."""
    now = timezone.now()
    for i in range(3):
        send(job="tests.noop", account=account.pk, ref=f"waiting-{i}")
    for i in range(2):
        send(job="exports.build", account=account.pk, ref=f"00000000-0000-0000-0000-00000000000{i}")

    for ref, acct, queue, reason in [
        ("h1", account, "exports", DeferReason.BUDGET_EXHAUSTED),
        ("h2", account, "exports", DeferReason.BUDGET_EXHAUSTED),
        ("h3", other_account, "default", DeferReason.CONCURRENCY_CAP),
        ("h4", account, "default", DeferReason.RETRY_BACKOFF),
    ]:
        hold(envelope=Envelope(job="tests.noop", account=acct.pk, ref=ref), queue=queue, reason=reason,
             eligible_at=now)

    for i, (acct, job_name, queue, outcome, cpu, db, st, wall) in enumerate([
        (account, "exports.build", "exports", Outcome.SUCCEEDED, 1500, 700, 300, 4000),
        (account, "exports.build", "exports", Outcome.SUCCEEDED, 500, 200, 100, 1000),
        (other_account, "exports.build", "exports", Outcome.FAILED, 20, 10, 0, 50),
        (account, "tests.noop", "default", Outcome.SUCCEEDED, 3, 1, 0, 4),
        (account, "tests.noop", "default", Outcome.REJECTED, 0, 0, 0, 0),
        (None, "scheduling.release_deferred", "default", Outcome.SUCCEEDED, 4, 2, 0, 6),
    ]):
        TaskRun.objects.create(account=acct, job=job_name, queue=queue, ref=f"r{i}", started_at=now, finished_at=now,
                               outcome=outcome, cpu_ms=cpu, db_wait_ms=db, storage_wait_ms=st, wall_ms=wall)
    TaskRun.objects.create(account=account, job="exports.build", queue="exports", ref="running", started_at=now)
    old_day = (now - dt.timedelta(days=30)).date()
    TaskRunDaily.objects.create(day=old_day, account=account, job="exports.build", queue="exports",
                                outcome=Outcome.SUCCEEDED, runs=10, cpu_ms=20_000, db_wait_ms=9_000,
                                storage_wait_ms=1_000, wall_ms=40_000, items=123)
    TaskRunDaily.objects.create(day=old_day, account=None, job="scheduling.release_deferred", queue="default",
                                outcome=Outcome.SUCCEEDED, runs=4, cpu_ms=40, wall_ms=60)
    TaskRunDaily.objects.create(day=old_day, account=account, job="exports.build", queue="exports",
                                outcome=Outcome.LOST, runs=2, cpu_ms=600)

    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=3600, max_concurrent=2)
    Budget.objects.create(account=account, queue="exports", cpu_seconds_per_day=1800, max_concurrent=1)
    Budget.objects.create(account=other_account, queue="default", cpu_seconds_per_day=600, max_concurrent=1)
    today = clock.budget_day()
    UsageDay.objects.create(account=account, queue="default", day=today, cpu_used_ms=1_500)
    UsageDay.objects.create(account=account, queue="exports", day=today, cpu_used_ms=250_000)
    UsageDay.objects.create(account=other_account, queue="default", day=today - dt.timedelta(days=1),
                            cpu_used_ms=599_000)  # yesterday: not today's use

    def export(status, rows=None, size=None):
        return ExportRecord.objects.create(account=account, start_date=dt.date(2026, 3, 1),
                                           end_date=dt.date(2026, 3, 2), source="activity", status=status,
                                           row_count=rows, byte_size=size)

    export(ExportStatus.SUCCEEDED, 1000, 64_000)
    export(ExportStatus.SUCCEEDED, 250, 16_500)
    export(ExportStatus.FAILED)
    export(ExportStatus.QUEUED)
    export(ExportStatus.QUEUED)

    WorkerHeartbeat.objects.create(worker="h:1", queue="default", seen_at=now)
    WorkerHeartbeat.objects.create(worker="h:2", queue="default", seen_at=now - dt.timedelta(seconds=20))
    WorkerHeartbeat.objects.create(worker="h:3", queue="exports", seen_at=now)
    WorkerHeartbeat.objects.create(worker="h:4", queue="exports", seen_at=now - dt.timedelta(minutes=5))


def _why_held() -> dict:
    held = list(DeferredTask.objects.all())
    waits = why_held(held)
    return {h: waits[h.pk] for h in held}


def test_metrics_parse_and_match_the_database(busy_system, account, other_account):
    m = scrape()

    # Queue depth: the broker's rows per queue.
    depth = {q: OrmQ.objects.filter(key=q).count() for q in ("default", "exports")}
    assert depth == {"default": 3, "exports": 2}
    assert by(m["fairshare_queue_depth"], "queue") == {(q,): n for q, n in depth.items()}
    ages = by(m["fairshare_queue_oldest_age_seconds"], "queue")
    # Both queues hold messages sent moments ago: their oldest is young, but not age zero.
    assert set(ages) == {("default",), ("exports",)} and all(0 < a < 60 for a in ages.values())

    # Held work by queue and what it waits for now (scheduling.waits): these are in their lines,
    # whose accounts could run (budget left, no slot taken), whatever they were held for.
    held = Counter((h.queue, wait.reason) for h, wait in _why_held().items())
    assert held == {("exports", "workers_busy"): 2, ("default", "workers_busy"): 2}
    assert by(m["fairshare_held_tasks"], "queue", "reason") == dict(held)
    assert m["fairshare_held_oldest_age_seconds"][()] > 0  # something is held, so its age is measured

    # Task runs by job and outcome: live rows plus the rolled-up days.
    runs = Counter(dict(((r["job"], r["outcome"]), r["n"]) for r in
                        TaskRun.objects.values("job", "outcome").annotate(n=Count("pk")).order_by()))
    for d in TaskRunDaily.objects.all():
        runs[(d.job, d.outcome)] += d.runs
    assert by(m["fairshare_task_runs_total"], "job", "outcome") == dict(runs)
    assert runs[("exports.build", "succeeded")] == 12
    assert by(m["fairshare_task_failures_total"], "job", "outcome") == {
        ("exports.build", "failed"): 1, ("exports.build", "lost"): 2, ("tests.noop", "rejected"): 1}
    cpu = by(m["fairshare_task_cpu_seconds_total"], "job")
    assert cpu[("exports.build",)] == pytest.approx((1500 + 500 + 20 + 20_000 + 600) / 1000)
    assert by(m["fairshare_task_db_wait_seconds_total"], "job")[("exports.build",)] == pytest.approx(9.91)
    assert by(m["fairshare_task_storage_wait_seconds_total"], "job")[("exports.build",)] == pytest.approx(1.4)
    assert by(m["fairshare_task_wall_seconds_total"], "job")[("scheduling.release_deferred",)] == pytest.approx(0.066)

    # Budget used and limit per account and queue (today's ledger only).
    assert by(m["fairshare_budget_cpu_limit_seconds"], "account", "queue") == {
        ("acme", "default"): 3600, ("acme", "exports"): 1800, ("globex", "default"): 600}
    assert by(m["fairshare_budget_cpu_used_seconds"], "account", "queue") == {
        ("acme", "default"): 1.5, ("acme", "exports"): 250, ("globex", "default"): 0}

    # Exports.
    assert m["fairshare_exports_retained"][()] == 2
    assert m["fairshare_export_rows_retained"][()] == 1250
    assert m["fairshare_export_bytes_retained"][()] == 80_500
    assert by(m["fairshare_exports"], "status") == {("succeeded",): 2, ("failed",): 1, ("queued",): 2}

    # Live workers per queue (heard from in the last minute).
    assert by(m["fairshare_workers_alive"], "queue") == {("default",): 2, ("exports",): 1}


def test_metrics_follow_the_database_between_scrapes(busy_system, account):
    before = scrape()
    TaskRun.objects.filter(job="tests.noop").delete()
    DeferredTask.objects.filter(reason=DeferReason.BUDGET_EXHAUSTED).delete()
    OrmQ.objects.filter(key="exports").delete()

    after = scrape()

    assert ("tests.noop", "succeeded") in by(before["fairshare_task_runs_total"], "job", "outcome")
    assert ("tests.noop", "succeeded") not in by(after["fairshare_task_runs_total"], "job", "outcome")
    assert by(after["fairshare_held_tasks"], "queue", "reason") == {("default", "workers_busy"): 2}
    assert by(after["fairshare_queue_depth"], "queue") == {("default",): 3, ("exports",): 0}


def test_metrics_answer_only_allowed_networks_or_the_bearer_token(busy_system, settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "METRICS_TOKEN": "s3cret-scrape-token",
                          "METRICS_ALLOWED_NETWORKS": "127.0.0.1/32, 10.20.0.0/16"}
    outside = Client(REMOTE_ADDR="203.0.113.7")

    refused = outside.get("/metrics")
    assert refused.status_code == 403
    assert b"fairshare_" not in refused.content
    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer wrong-token").status_code == 403
    assert outside.get("/metrics", HTTP_AUTHORIZATION="s3cret-scrape-token").status_code == 403  # no scheme

    assert "fairshare_queue_depth" in scrape(outside, HTTP_AUTHORIZATION="Bearer s3cret-scrape-token")
    assert "fairshare_queue_depth" in scrape(Client(REMOTE_ADDR="10.20.3.4"))
    assert "fairshare_queue_depth" in scrape(Client(REMOTE_ADDR="127.0.0.1"))
    assert Client(REMOTE_ADDR="10.21.0.1").get("/metrics").status_code == 403


def test_metrics_without_a_configured_token_refuse_an_empty_bearer(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "METRICS_TOKEN": "", "METRICS_ALLOWED_NETWORKS": "127.0.0.1/32"}
    outside = Client(REMOTE_ADDR="198.51.100.1")

    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer ").status_code == 403
    assert outside.get("/metrics", HTTP_AUTHORIZATION="Bearer").status_code == 403


# --- /healthz ---------------------------------------------------------------------------------

def healthz() -> tuple[int, dict]:
    response = Client().get("/healthz")
    return response.status_code, response.json()


def beat(queue: str, age_s: float = 0, worker: str | None = None) -> None:
    WorkerHeartbeat.objects.update_or_create(
        worker=worker or f"host:{queue}",
        defaults={"queue": queue, "seen_at": timezone.now() - dt.timedelta(seconds=age_s)})


def test_healthz_is_200_when_database_workers_and_storage_are_fine():
    beat("default", age_s=5)
    beat("exports", age_s=30)

    status, body = healthz()

    assert status == 200
    assert body == {"status": "ok", "checks": {"database": "ok", "workers:default": "ok", "workers:exports": "ok",
                                                "export_storage": "ok"}}


def test_healthz_names_a_queue_whose_workers_went_quiet(settings):
    settings.FAIRSHARE = {**settings.FAIRSHARE, "HEALTH_HEARTBEAT_MAX_AGE_S": 60}
    beat("default")
    beat("exports", age_s=61)

    status, body = healthz()

    assert status == 503
    assert body["status"] == "fail"
    failing = {name for name, state in body["checks"].items() if state != "ok"}
    assert failing == {"workers:exports"}
    assert "60 s" in body["checks"]["workers:exports"]


def test_healthz_names_export_storage_that_cannot_be_written(settings, tmp_path):
    beat("default")
    beat("exports")
    not_a_folder = tmp_path / "exports-root-is-a-file"
    not_a_folder.write_text("")
    settings.STORAGES = {**settings.STORAGES, "exports": {
        **settings.STORAGES["exports"],
        "OPTIONS": {**settings.STORAGES["exports"]["OPTIONS"], "location": str(not_a_folder)}}}

    status, body = healthz()

    assert status == 503
    assert {n for n, s in body["checks"].items() if s != "ok"} == {"export_storage"}
    assert body["checks"]["export_storage"].startswith("not writable (")
    assert str(tmp_path) not in json.dumps(body)  # no paths or other details leak


def test_healthz_probe_leaves_nothing_behind(export_root):
    beat("default")
    beat("exports")

    assert healthz()[0] == 200
    assert [p for p in export_root.rglob("*") if p.is_file()] == []


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.django_db(transaction=True)
def test_healthz_names_the_database_when_postgresql_is_unreachable():
    # transaction=True: the check must really lose its connection, which would break the
    # enclosing test transaction of a plain django_db test.
    beat("default")
    beat("exports")
    port = connection.settings_dict["PORT"]
    connection.close()
    try:
        connection.settings_dict["PORT"] = _closed_port()
        status, body = healthz()
    finally:
        connection.settings_dict["PORT"] = port
        connection.close()
        connection.ensure_connection()

    assert status == 503
    assert body["checks"]["database"] == "unreachable (OperationalError)"
    assert body["checks"]["export_storage"] == "ok"
    # The heartbeats live in the database too: their state is unknown, not "ok".
    assert body["checks"]["workers:default"].startswith("unknown")
    # Reconnected: healthy again.
    assert healthz()[0] == 200


@pytest.mark.django_db(transaction=True)
@pytest.mark.processes
def test_healthz_turns_200_once_real_workers_of_both_queues_beat(start_cluster):
    status, body = healthz()
    assert status == 503
    assert {n for n, s in body["checks"].items() if s != "ok"} == {"workers:default", "workers:exports"}

    default, exports = start_cluster("default"), start_cluster("exports")

    wait_for(lambda: healthz()[0] == 200, timeout=30, interval=0.5,
             message=f"/healthz to turn 200; logs:\n{default.log()}\n{exports.log()}")
    # Written by each worker process's pulse thread, started on django-q2's post_spawn signal.
    assert set(WorkerHeartbeat.objects.values_list("queue", flat=True)) == {"default", "exports"}


# --- The structured log line ------------------------------------------------------------------

def test_the_task_finished_line_is_one_json_object_without_exception_text(caplog):
    caplog.set_level(logging.INFO, logger="fairshare.tasks")

    execute({"v": 1, "job": "tests.ops_leaky_failure", "account": None, "ref": "leak-1"})

    finished = [r for r in caplog.records if r.name == "fairshare.tasks" and r.getMessage() == "task finished"]
    assert len(finished) == 1
    line = JsonFormatter().format(finished[0])
    assert "\n" not in line
    data = json.loads(line)
    run = TaskRun.objects.get(job="tests.ops_leaky_failure")
    assert {k: data[k] for k in ("level", "logger", "msg", "job", "outcome", "task_run")} == {
        "level": "INFO", "logger": "fairshare.tasks", "msg": "task finished", "job": "tests.ops_leaky_failure",
        "outcome": "failed", "task_run": run.pk}
    assert isinstance(data["cpu_ms"], int) and isinstance(data["wall_ms"], int)
    assert data["cpu_ms"] >= 0 and data["wall_ms"] >= 0
    for leaked in ("alice", "hunter2", "4111111111111111", "ValueError("):
        assert leaked not in line
    # The run record keeps the class and a redacted message.
    assert run.outcome == Outcome.FAILED and run.error_class == "ValueError"
    assert "hunter2" not in run.error_message and "alice@example.com" not in run.error_message


def test_the_json_formatter_keeps_only_the_class_of_a_logged_exception():
    try:
        raise ValueError(SECRET_TEXT)
    except ValueError:
        record = logging.LogRecord("fairshare.tasks", logging.ERROR, __file__, 1, "task crashed", (), sys.exc_info())
    record.job, record.outcome, record.cpu_ms, record.wall_ms = "exports.build", "failed", 12, 40

    line = JsonFormatter().format(record)

    data = json.loads(line)
    assert data["exc_class"] == "ValueError"
    assert (data["job"], data["outcome"], data["cpu_ms"], data["wall_ms"]) == ("exports.build", "failed", 12, 40)
    assert "hunter2" not in line and "alice" not in line and "Traceback" not in line
    assert data["ts"].endswith("Z")


def test_log_format_json_makes_the_console_write_json_lines():
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "SECRET_KEY": "x", "LOG_FORMAT": "json",
           "LOG_LEVEL": "INFO"}
    code = ("import django, logging; django.setup(); logging.getLogger('fairshare.tasks').info('task finished', "
            "extra={'job': 'exports.build', 'outcome': 'succeeded', 'cpu_ms': 12, 'wall_ms': 30, 'task_run': 7})")

    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1]["msg"] == "task finished"
    assert {k: lines[-1][k] for k in ("job", "outcome", "cpu_ms", "wall_ms", "task_run")} == {
        "job": "exports.build", "outcome": "succeeded", "cpu_ms": 12, "wall_ms": 30, "task_run": 7}
