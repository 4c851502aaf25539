"""Jobs for the test suite, loaded by workers started with FAIRSHARE_EXTRA_JOB_MODULES=tests.jobs.

The envelope carries identifiers only, so a test job reads its parameter from its ref:
"<milliseconds>/<unique id>".
"""
import time

from scheduling.registry import job


def _ms(ctx) -> int:
    return int(ctx.envelope.ref.split("/", 1)[0])


@job("tests.noop", cpu_estimate_ms=10)
def noop(ctx) -> None:
    ctx.items = 1


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
