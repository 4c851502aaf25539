"""Jobs for the test suite, loaded by workers started with FAIRSHARE_EXTRA_JOB_MODULES=tests.jobs.

The envelope carries identifiers only, so a test job reads its parameter from its ref:
"<milliseconds>/<unique id>".
"""
import os
import time

from django.db import connection

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


@job("tests.hold_exports_worker", queue="exports", cpu_estimate_ms=10)
def hold_exports_worker(ctx) -> None:
    """Occupies an exports worker until the file named by FAIRSHARE_TEST_GATE exists, or for at
    most the ref's milliseconds."""
    gate = os.environ.get(testing.TEST_GATE.env, "")
    end = time.monotonic() + _ms(ctx) / 1000
    while time.monotonic() < end and not (gate and os.path.exists(gate)):
        time.sleep(0.05)


@job("tests.drop_connection", cpu_estimate_ms=10)
def drop_connection(ctx) -> None:
    """Fails the way a dropped database connection fails: its server process is terminated."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
