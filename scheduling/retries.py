"""Classifying failures and spacing retries (exponential back-off with full jitter).

Transient: the same work may succeed later (a dropped database connection, a storage timeout).
Terminal: it will not (unauthorised, unsupported input, a broken contract) — and so is anything
we have not classified: retrying the unknown only multiplies load.
Not a failure at all: a run that had to stop and wait (`MustWait`).
"""
import random
from dataclasses import dataclass

import psycopg
from django.db import InterfaceError, OperationalError

TRANSIENT: tuple[type[BaseException], ...] = (
    OperationalError, InterfaceError, ConnectionError, TimeoutError,  # socket.timeout is TimeoutError
)
try:  # S3 through django-storages
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

    TRANSIENT += (BotoConnectionError, ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError)
except ImportError:  # pragma: no cover - botocore is installed with django-storages[s3]
    pass

# The raw psycopg connection exports stream from (exports.streaming): its errors are not Django's.
TRANSIENT += (psycopg.OperationalError, psycopg.InterfaceError)


class MustWait(Exception):
    """Not a failure: the run had to stop and its job must wait (e.g. its account's daily budget
    ran out). The middleware that raised it holds the job; the retry middleware lets it through
    without counting an attempt. budgets.limits.BudgetExhausted is one."""


class TransientError(Exception):
    """Raise (or subclass) to mark a failure as worth retrying."""


TRANSIENT += (TransientError,)


def is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TRANSIENT)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int = 5
    base_s: float = 2.0
    cap_s: float = 300.0

    def delay(self, attempt: int, rng: random.Random = random._inst) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2^(attempt-1))] — spreads a thundering herd."""
        return rng.uniform(0, min(self.cap_s, self.base_s * 2 ** (attempt - 1)))
