"""Jobs for the test suite, loaded by workers started with FAIRSHARE_EXTRA_JOB_MODULES=tests.jobs.

The envelope carries identifiers only, so a test job reads its parameter from its ref:
"<milliseconds>/<unique id>".
"""
import logging
import os
import time

from django.db import connection, transaction

from scheduling import testing
from scheduling.jobs import noop
from scheduling.registry import job

# The one no-op handler (scheduling.noop's), also registered under the name the tests enqueue and
# assert on (TaskRun.job == "tests.noop"), with the estimate it has always had here.
job("tests.noop", cpu_estimate_ms=10)(noop)


def _ms(ctx) -> int:
    return int(ctx.envelope.ref.split("/", 1)[0])


@job("tests.spin", cpu_estimate_ms=100)
def spin(ctx) -> None:
    """Burns CPU and never checks its budget: only RLIMIT_CPU can stop it."""
    end = time.process_time() + _ms(ctx) / 1000
    n = 0
    while time.process_time() < end:
        n += 1
    ctx.items = n


@job("tests.spin_checked", cpu_estimate_ms=100)
def spin_checked(ctx) -> None:
    """Burns CPU in slices, checking its budget between them like a well-behaved long job."""
    end = time.process_time() + _ms(ctx) / 1000
    while time.process_time() < end:
        slice_end = min(end, time.process_time() + 0.05)
        while time.process_time() < slice_end:
            pass
        ctx.budget.check()


@job("tests.sleep", cpu_estimate_ms=10)
def sleep(ctx) -> None:
    """Holds its slot for a while without using CPU."""
    time.sleep(_ms(ctx) / 1000)


@job("tests.sleep_checked", cpu_estimate_ms=10)
def sleep_checked(ctx) -> None:
    """Holds its slot for a while without using CPU, checking its budget every 50 ms like a long
    job between batches (a job its watcher may stop)."""
    end = time.monotonic() + _ms(ctx) / 1000
    while time.monotonic() < end:
        time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        ctx.budget.check()


@job("tests.hold_exports_worker", queue="exports", cpu_estimate_ms=10)
def hold_exports_worker(ctx) -> None:
    """Occupies an exports worker until the file named by FAIRSHARE_TEST_GATE exists, or for at
    most the ref's milliseconds."""
    gate = os.environ.get(testing.TEST_GATE.env, "")
    end = time.monotonic() + _ms(ctx) / 1000
    while time.monotonic() < end and not (gate and os.path.exists(gate)):
        time.sleep(0.05)


FROZEN_WRITE = "written by a transaction whose worker froze"


@job("tests.hold_row_lock", cpu_estimate_ms=10)
def hold_row_lock(ctx) -> None:
    """Writes to the queued export its ref names ("<ms>/<export id>") inside a transaction, which
    holds that row's lock, and commits only once FAIRSHARE_TEST_GATE exists (or after the ref's
    milliseconds): a worker frozen here is a frozen lock holder."""
    from exports.models import ExportRecord, ExportStatus

    export_id = ctx.envelope.ref.split("/", 1)[1]
    gate = os.environ.get(testing.TEST_GATE.env, "")
    end = time.monotonic() + _ms(ctx) / 1000
    with transaction.atomic():
        ExportRecord.objects.filter(pk=export_id, status=ExportStatus.QUEUED).update(error_message=FROZEN_WRITE)
        while time.monotonic() < end and not (gate and os.path.exists(gate)):
            time.sleep(0.05)


@job("tests.drop_connection", cpu_estimate_ms=10)
def drop_connection(ctx) -> None:
    """Fails the way a dropped database connection fails: its server process is terminated."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")


# --- Planted secrets (tests/test_planted_secrets.py) -------------------------------------------
# Each kind of secret a failure may quote, in the words a real library would use; `PLANTED` is the
# part that must never be stored, logged or shown, `MEANING` what the redacted message still says.
SECRETS = {
    "dsn": "could not connect to postgres://app:Dsn-pa55word@db.internal:5432/prod",
    "aws-key-id": "The AWS Access Key Id AKIAIOSFODNN7EXAMPLE you provided does not exist in our records",
    "aws-session": "ExpiredToken: the security token for ASIAY34FZKBOKMUTVV7A has expired",
    "api-token": "upstream rejected fs_PlantedToken1234567890abcdef as unknown",
    "bearer": "401 Unauthorized for Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.cGxhbnRlZA.c2lnbmF0dXJl",
    "key-named": "config loaded with stripe_secret_key=sk_live_PlantedSecret99 from the environment",
    "card": "card 4111 1111 1111 1111 declined by the issuer",
    "email": "could not notify planted.person@example.com about the report",
    "pg-auth": 'password authentication failed for user "app" (password=Pg-pa55word)',
}
PLANTED = ["Dsn-pa55word", "AKIAIOSFODNN7EXAMPLE", "ASIAY34FZKBOKMUTVV7A", "fs_PlantedToken1234567890abcdef",
           "eyJhbGciOiJIUzI1NiJ9.cGxhbnRlZA.c2lnbmF0dXJl", "sk_live_PlantedSecret99", "4111 1111 1111 1111",
           "planted.person@example.com", "Pg-pa55word"]
MEANING = {
    "dsn": "could not connect to postgres://***@db.internal:5432/prod",
    "aws-key-id": "you provided does not exist in our records",
    "aws-session": "has expired",
    "api-token": "upstream rejected fs_*** as unknown",
    "bearer": "401 Unauthorized",
    "key-named": "from the environment",
    "card": "declined by the issuer",
    "email": "could not notify ***@*** about the report",
    "pg-auth": "password authentication failed for user",
}
_leak_log = logging.getLogger("fairshare.tests.leak")


@job("tests.leak", cpu_estimate_ms=10)
def leak(ctx) -> None:
    """Logs and raises the secret its ref names ("<kind>/<id>"), chained to another one."""
    kind = ctx.envelope.ref.split("/", 1)[0]
    _leak_log.error("calling upstream failed: %s", SECRETS[kind])
    try:
        raise KeyError(SECRETS["dsn"])
    except KeyError:
        _leak_log.exception("while handling %s", SECRETS[kind])
        raise RuntimeError(SECRETS[kind]) from ValueError(SECRETS["pg-auth"])


@job("tests.leak_timeout", cpu_estimate_ms=10)
def leak_timeout(ctx) -> None:
    """Hits the task time limit while handling an exception that quotes every secret."""
    try:
        raise ConnectionError(" / ".join(SECRETS.values()))
    except ConnectionError:
        time.sleep(_ms(ctx) / 1000)  # django-q2's SIGALRM lands here

# A job whose work goes before the account's other held work unless enqueued with a priority of its own.
job("tests.noop_urgent", cpu_estimate_ms=10, priority=50)(noop)
