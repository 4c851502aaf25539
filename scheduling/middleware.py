"""The task middleware chain, Django-style: each middleware wraps the rest of the chain.

    class MyMiddleware:
        def __init__(self, call_next): self.call_next = call_next
        def __call__(self, ctx): ...; self.call_next(ctx); ...
"""
import datetime as dt
import logging

from django_q.conf import Conf

from scheduling import clock, holding, services
from scheduling import envelope as contract
from scheduling.models import DeferReason, Outcome
from scheduling.registry import get_job
from scheduling.retries import MustWait, is_transient
from scheduling.connections import close_old_connections, retry_on_disconnect

logger = logging.getLogger("fairshare.tasks")


class ContractMiddleware:
    """Validate the envelope and resolve its job; reject (and record) anything else. A message of
    a newer envelope version than this worker speaks is parked for a worker that speaks it."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        try:
            ctx.envelope = contract.parse(ctx.message)
            ctx.job = get_job(ctx.envelope.job)
            if ctx.job.account_scoped and ctx.envelope.account is None:
                raise contract.ContractError(f"job {ctx.job.name!r} needs an account")
        except contract.NeedsNewerWorker as exc:
            # A rolling upgrade: a newer producer sent it before this worker was upgraded.
            held = holding.park(message=ctx.message, version=exc.version, queue=Conf.CLUSTER_NAME)
            logger.warning("task parked: needs a newer worker",
                           extra={"deferred_task": held.pk, "envelope_version": exc.version})
            return
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
        # An account's run is inserted by its admission, with its slot and in the same transaction
        # (services.task_run_mark_started), or, if it is not admitted, when it ends (`_finish`).
        # (A handed-off job's run may have been recorded ahead, by the admission made with its claim.)
        start = services.task_run_new if ctx.job.account_scoped else services.task_run_start
        if ctx.run is None:
            ctx.run = start(job=ctx.job.name, queue=ctx.job.queue, account_id=ctx.envelope.account,
                            ref=ctx.envelope.ref)
        error: BaseException | None = None
        try:
            with ctx.meter.measure():
                self.call_next(ctx)
        except Exception as exc:
            error = exc
        except BaseException as exc:
            # django-q2's time limit (TimeoutException, a SystemExit raised by SIGALRM) or a
            # shutdown: record it here, redacted, then let through only a bare exception of the
            # same kind. django-q2 stores and logs `traceback.format_exc()`, which would carry the
            # text of the exception this one interrupted (`from None` drops the chain).
            self._finish(ctx, exc)
            raise _bare(exc) from None
        self._finish(ctx, error)

    def _finish(self, ctx, error: BaseException | None) -> None:
        error = error or ctx.error
        outcome = services.final_outcome(ctx.outcome, error)
        if ctx.run.outcome == Outcome.RUNNING:  # else a middleware recorded its end (budgets' settlement)
            close_old_connections()
            retry_on_disconnect(lambda: services.task_run_finish(
                run=ctx.run, outcome=outcome, meter=ctx.meter, items=ctx.items, error=error))
        logger.info(
            "task finished",
            extra={
                "job": ctx.job.name, "task_run": ctx.run.pk, "outcome": outcome,
                "cpu_ms": ctx.meter.cpu_ms, "wall_ms": ctx.meter.wall_ms,
            },
        )


def _bare(exc: BaseException) -> BaseException:
    """An exception of `exc`'s kind that carries no text from the job: what django-q2 may see."""
    from django_q.exceptions import TimeoutException

    if isinstance(exc, TimeoutException):
        # Still a TimeoutException: django-q2 then replaces this worker process, as it should.
        return TimeoutException("the task hit its time limit (recorded in its task run)")
    if isinstance(exc, SystemExit):
        return SystemExit(exc.code if isinstance(exc.code, int) else 1)
    if isinstance(exc, KeyboardInterrupt):
        return KeyboardInterrupt()
    return exc


class RetryMiddleware:
    """Classify a failure: transient ones wait in the holding area and run again after an
    exponential back-off with full jitter; terminal ones (and the last attempt) give up for good."""

    def __init__(self, call_next):
        self.call_next = call_next

    def __call__(self, ctx) -> None:
        try:
            self.call_next(ctx)
        except MustWait:
            raise  # not a failure: the middleware that raised it holds the job (no attempt used)
        except Exception as exc:
            ctx.error = exc
            policy = ctx.job.retry
            # The failure may have broken this worker's connection (a dropped database connection
            # is the classic transient error): reconnect before counting retries and holding.
            close_old_connections()
            attempt = services.retries_so_far(job=ctx.job.name, ref=ctx.envelope.ref) + 1
            if is_transient(exc) and ctx.envelope.account is not None and attempt < policy.max_attempts:
                holding.hold(
                    envelope=ctx.envelope, queue=ctx.job.queue, reason=DeferReason.RETRY_BACKOFF,
                    eligible_at=clock.now() + dt.timedelta(seconds=policy.delay(attempt)),
                )
                ctx.outcome = Outcome.RETRYING
                return
            ctx.outcome = Outcome.FAILED
            if ctx.job.on_give_up is not None:
                ctx.job.on_give_up(ctx, exc)
