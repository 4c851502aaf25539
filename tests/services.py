"""The one way a test says it needs a service the machine may not have (Redis, the S3 server, a
browser, PostgreSQL's server binaries): `needs_service(name, why)` where the service is missing.

On a developer's machine the test skips, naming the service and how to get it. Under CI=true (CI
sets it) it fails instead, naming it too: scripts/test installs and starts what it can, so a
service still missing there is a broken CI machine, and a run that passes by skipping would say
nothing about the code it skipped. No Django here: importable by a test run of its own
(tests/test_services.py).
"""
import os
from typing import NoReturn

import pytest

from scheduling.conf import flag


def in_ci() -> bool:
    return flag(os.environ.get("CI", ""))


def needs_service(service: str, why: str) -> NoReturn:
    """Skip the calling test (from it or its fixture), or under CI=true fail it. Not at module level:
    a failure there would stop the whole run at collection instead of failing this test."""
    if in_ci():
        pytest.fail(f"CI=true and this test needs {service}, which is missing: {why}", pytrace=False)
    pytest.skip(f"needs {service}: {why}")
