"""The task middleware chain, Django-style: each middleware wraps the rest of the chain.

    class MyMiddleware:
        def __init__(self, call_next): self.call_next = call_next
        def __call__(self, ctx): ...; self.call_next(ctx); ...
"""
import logging

from django.db import close_old_connections, connections

from scheduling import envelope as contract
from scheduling import services
from scheduling.models import Outcome
from scheduling.registry import get_job

logger = logging.getLogger("fairshare.tasks")


def _close_broken_connections() -> None:
    """Close this thread's connections that died or were left unusable during the run.

    Not `close_old_connections()`: with CONN_MAX_AGE = 0 (our default) that closes every
    connection, healthy or not, so recording the outcome paid for a new database connection on
    every run. A connection that fails a liveness check, or was left outside autocommit, is
    closed just the same, and the next query opens a fresh one.
    """
    for conn in connections.all(initialized_only=True):
        if conn.connection is None or conn.in_atomic_block:
            continue
        if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"] or not conn.is_usable():
            conn.close()


class ContractMiddleware:
    """Validate the envelope and resolve its job; reject (and record) anything else."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        try:
            ctx.envelope = contract.parse(ctx.message)
            ctx.job = get_job(ctx.envelope.job)
            if ctx.job.account_scoped and ctx.envelope.account is None:
                raise contract.ContractError(f"job {ctx.job.name!r} needs an account")
        except contract.ContractError as exc:
            run = services.task_run_reject(message=ctx.message, error=exc)
            logger.error("task rejected", extra={"task_run": run.pk, "error_class": run.error_class})
            return
        self.call_next(ctx)


class RunRecordingMiddleware:
    """Record a TaskRun around the rest of the chain, metered (CPU, wall, DB/storage wait).

    This is the failure boundary: an exception is recorded (redacted) and goes no further, so
    django-q2 never stores or logs a raw traceback with customer data in it.
    """

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        # A worker process lives across many tasks; don't start on a connection that died.
        close_old_connections()
        ctx.run = services.task_run_start(
            job=ctx.job.name, queue=ctx.job.queue, account_id=ctx.envelope.account, ref=ctx.envelope.ref,
        )
        error: BaseException | None = None
        try:
            with ctx.meter.measure():
                self.call_next(ctx)
        except Exception as exc:
            error = exc
        except BaseException as exc:
            # django-q2's timeout (a SystemExit) or a shutdown: record, then let it through.
            self._finish(ctx, exc)
            raise
        self._finish(ctx, error)

    def _finish(self, ctx, error: BaseException | None) -> None:
        outcome = Outcome.FAILED if error is not None else (ctx.outcome or Outcome.SUCCEEDED)
        _close_broken_connections()
        services.task_run_finish(run=ctx.run, outcome=outcome, meter=ctx.meter, items=ctx.items, error=error)
        logger.info(
            "task finished",
            extra={
                "job": ctx.job.name, "task_run": ctx.run.pk, "outcome": outcome,
                "cpu_ms": ctx.meter.cpu_ms, "wall_ms": ctx.meter.wall_ms,
            },
        )
