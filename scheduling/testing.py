"""Test-only seams: every environment variable that exists so the test suite can steer real worker
processes. Each is inert while unset.

The rule: settings refuse to start (ImproperlyConfigured, from config/settings.py, in every
process: web, qcluster, management commands) when any seam is set and FAIRSHARE_TESTING is not.
scripts/test exports FAIRSHARE_TESTING=1, and the workers a test starts get it too
(tests/conftest.py `worker_env`). DEBUG is no licence: the demo runs with DEBUG=1 and no seams.

Who reads each seam:
  FAIRSHARE_CLOCK_OFFSET        -> FAIRSHARE["CLOCK_OFFSET_S"], read by scheduling/clock.py now()
  FAIRSHARE_TEST_SPEAKS_ENVELOPE_VERSION -> FAIRSHARE["SPEAKS_ENVELOPE_VERSION"], read by
                                   scheduling/envelope.py known_version() (a "newer worker")
  FAIRSHARE_FAULT (+ _MARKER, _RESUME) -> scheduling/faults.py `fault_point` (its points are listed there)
  FAIRSHARE_TEST_GATE           -> tests/jobs.py `hold_exports_worker`, `hold_row_lock`
  FAIRSHARE_TEST_PUBLISH_GATE   -> tests/storages.py `GatedStorage`
  FLAKY_STORAGE_FAILURES_FILE   -> tests/storages.py `FlakyStorage`
  FAIRSHARE_TEST_SIGNAL_LOG     -> tests/tasks/functions.py (the Tasks framework's signals in a worker)

FAIRSHARE_EXTRA_JOB_MODULES is not a seam: host applications use it (scheduling/conf.py).

Importable before Django is set up (config/settings.py imports it): no django.conf here.
"""
import os
from collections.abc import Mapping

from django.core.exceptions import ImproperlyConfigured

from scheduling.conf import Setting, flag

TESTING = Setting(None, "FAIRSHARE_TESTING", False, parse=flag, sets="(the seams' switch)",
                  doc="`1` while the test suite runs (scripts/test exports it): allows the seams below")

CLOCK_OFFSET = Setting(
    "CLOCK_OFFSET_S", "FAIRSHARE_CLOCK_OFFSET", 0, parse=int, unit="s",
    doc="shifts the kernel's clock (holding area, budgets) so a test can move real worker processes to "
        "tomorrow")
SPEAKS_ENVELOPE_VERSION = Setting(
    "SPEAKS_ENVELOPE_VERSION", "FAIRSHARE_TEST_SPEAKS_ENVELOPE_VERSION", None, parse=int, shown_default="unset",
    doc="the newest envelope version this process speaks, raised above the code's own so a test can start "
        "a newer worker")
FAULT = Setting(None, "FAIRSHARE_FAULT", None, sets="`scheduling.faults`",
                doc="the fault point at which a worker process kills itself (SIGKILL)")
FAULT_MARKER = Setting(None, "FAIRSHARE_FAULT_MARKER", None, sets="`scheduling.faults`",
                       doc="a file path: the fault fires once, in the process that creates this file")
FAULT_RESUME = Setting(None, "FAIRSHARE_FAULT_RESUME", None, sets="`scheduling.faults`",
                       doc="a file path: the fault point pauses the process until this file exists (at most 60 s) "
                           "instead of killing it")
TEST_GATE = Setting(None, "FAIRSHARE_TEST_GATE", None, sets="`tests.jobs`",
                    doc="a file path: `tests.hold_exports_worker` and `tests.hold_row_lock` run until this file exists")
TEST_PUBLISH_GATE = Setting(None, "FAIRSHARE_TEST_PUBLISH_GATE", None, sets="`tests.storages`",
                            doc="a file path: `GatedStorage` saves wait until this file exists")
FLAKY_STORAGE_FAILURES = Setting(None, "FLAKY_STORAGE_FAILURES_FILE", None, sets="`tests.storages`",
                                 doc="a file holding how many more `FlakyStorage` saves should fail")
TEST_SIGNAL_LOG = Setting(None, "FAIRSHARE_TEST_SIGNAL_LOG", None, sets="`tests.tasks.functions`",
                          doc="a file path: a worker appends a line to it for each Django task signal it sends")

SEAMS = (CLOCK_OFFSET, SPEAKS_ENVELOPE_VERSION, FAULT, FAULT_MARKER, FAULT_RESUME, TEST_GATE, TEST_PUBLISH_GATE,
         FLAKY_STORAGE_FAILURES, TEST_SIGNAL_LOG)
# The seams that are FAIRSHARE keys (tests may also override them in-process with `settings`).
SETTINGS = (CLOCK_OFFSET, SPEAKS_ENVELOPE_VERSION)


def refuse_seams_unless_testing(environ: Mapping[str, str] = os.environ) -> None:
    """Raise ImproperlyConfigured when a seam is set outside the test suite."""
    armed = [seam.env for seam in SEAMS if environ.get(seam.env)]
    if armed and not TESTING.read(environ):
        raise ImproperlyConfigured(
            f"{', '.join(armed)} {'is' if len(armed) == 1 else 'are'} test-only (scheduling/testing.py) "
            f"and refused outside the test suite: unset {'it' if len(armed) == 1 else 'them'}, "
            f"or export {TESTING.env}=1 if this process belongs to a test.")
