"""One attempt at building an export: claim, reconcile or build, publish, complete, notify."""
import logging
import time
from dataclasses import dataclass
from uuid import UUID

from django.conf import settings
from django.db.models.functions import Now

from budgets.limits import BudgetExhausted, RunBudget
from budgets.tenancy import can_export
from exports import storage
from exports.leases import (
    ExportCancelled, ExportSuperseded, export_checkpoint, export_claim, export_complete, export_finish_cancelled,
    export_unclaim, lost_ownership_error,
)
from exports.models import AttemptOutcome, ExportAttempt, ExportRecord
from exports.notify import export_notify_once
from exports.sources import day_bounds, get_source
from exports.streaming import stream_csv
from scheduling.faults import fault_point
from scheduling.metering import Meter
from scheduling.models import Outcome, TaskRun
from scheduling.redaction import describe_error
from scheduling.context import UnlimitedBudget
from scheduling.connections import close_old_connections

logger = logging.getLogger("fairshare.exports")


class ExportNotAuthorised(Exception):
    """The export may no longer be built (account deactivated, requester lost the right)."""


class ExportTimeLimit(Exception):
    """The attempt ran past its overall deadline (EXPORT_ATTEMPT_DEADLINE_S)."""


@dataclass(frozen=True)
class BuildResult:
    outcome: str  # a scheduling Outcome
    rows: int = 0


class _Progress:
    """An attempt's rows so far, and the checks it makes between batches and before publishing:
    still ours and not cancelled (the lease checkpoint), in budget, in time."""

    def __init__(self, *, export_id: UUID, epoch: int, budget: RunBudget):
        self.export_id, self.epoch, self.budget = export_id, epoch, budget
        self.deadline = time.monotonic() + settings.FAIRSHARE["EXPORT_ATTEMPT_DEADLINE_S"]
        self.rows = 0

    def checkpoint(self, rows_so_far: int) -> None:
        self.rows = rows_so_far
        export_checkpoint(export_id=self.export_id, epoch=self.epoch, rows_written=rows_so_far)
        self.budget.check()
        if time.monotonic() > self.deadline:
            raise ExportTimeLimit(f"the attempt passed its {settings.FAIRSHARE['EXPORT_ATTEMPT_DEADLINE_S']} s deadline")

    def on_batch(self, rows_so_far: int) -> None:
        self.checkpoint(rows_so_far)
        fault_point("mid_stream")


def _attempt_finish(attempt: ExportAttempt, *, outcome: str, rows: int, error: BaseException | None = None) -> None:
    error_class, message = describe_error(error) if error is not None else ("", "")
    ExportAttempt.objects.filter(pk=attempt.pk).update(
        outcome=outcome, rows_written=rows, error_class=error_class, error_message=message, finished_at=Now(),
    )


def _authorise(record: ExportRecord) -> None:
    account = record.account
    if not account.is_active:
        raise ExportNotAuthorised("the account is not active")
    if record.requested_by is not None and not can_export(user=record.requested_by, account=account):
        raise ExportNotAuthorised("the requester may no longer export this account")


def export_build(
    *, export_id: UUID, account_id: int, owner: str, meter: Meter, task_run: TaskRun | None = None,
    budget: RunBudget | None = None,
) -> BuildResult:
    """One attempt: claim, reconcile or build, publish under the export's key, complete, notify.

    Between batches it checkpoints its lease, honours cancellation, the attempt's deadline and the
    run's CPU budget. Failures give the claim back (`export_unclaim`) and propagate to the retry
    middleware, which decides between a retry and giving up (`export_give_up`).
    """
    budget = budget or UnlimitedBudget()
    fault_point("before_claim")
    attempt = export_claim(export_id=export_id, account_id=account_id, owner=owner, task_run=task_run)
    if attempt is None:
        # Nothing to build — but a run that died after completing may still owe the notification.
        export_notify_once(export_id=export_id)
        return BuildResult(outcome=Outcome.SKIPPED)
    fault_point("after_claim")
    record = attempt.export
    epoch = attempt.epoch
    key = storage.object_key(account_id=record.account_id, export_id=record.pk)
    progress = _Progress(export_id=record.pk, epoch=epoch, budget=budget)
    try:
        outcome, rows = _produce(record, epoch=epoch, key=key, meter=meter, progress=progress)
    except ExportSuperseded:
        _attempt_finish(attempt, outcome=AttemptOutcome.SUPERSEDED, rows=progress.rows)
        return BuildResult(outcome=Outcome.SKIPPED, rows=progress.rows)
    except ExportCancelled:
        storage.delete(key=key)  # whatever this attempt may have published
        export_finish_cancelled(export_id=record.pk, epoch=epoch)
        _attempt_finish(attempt, outcome=AttemptOutcome.CANCELLED, rows=progress.rows)
        return BuildResult(outcome=Outcome.CANCELLED, rows=progress.rows)
    except BudgetExhausted:
        export_unclaim(export_id=record.pk, epoch=epoch, refund_attempt=True)
        _attempt_finish(attempt, outcome=AttemptOutcome.BUDGET_EXHAUSTED, rows=progress.rows)
        raise
    except BaseException as exc:
        _record_failure(attempt, rows=progress.rows, error=exc)
        raise
    _attempt_finish(attempt, outcome=outcome, rows=rows)
    fault_point("before_notify")
    export_notify_once(export_id=record.pk)
    fault_point("after_complete")
    logger.info("export completed", extra={"export": str(record.pk), "rows": rows, "how": outcome})
    return BuildResult(outcome=Outcome.SUCCEEDED, rows=rows)


def _produce(record: ExportRecord, *, epoch: int, key: str, meter: Meter, progress: _Progress) -> tuple[str, int]:
    """Reuse what an earlier attempt published under the key, or build and publish; then complete
    under the fence. Returns the attempt's outcome and the export's rows."""
    _authorise(record)
    outcome = AttemptOutcome.RECONCILED
    result = storage.find_published(key=key, export_id=record.pk, meter=meter)
    if result is None:
        outcome = AttemptOutcome.SUCCEEDED
        result = _build_and_publish(record, key=key, meter=meter, on_batch=progress.on_batch,
                                    checkpoint=progress.checkpoint)
        fault_point("after_publish")
    progress.rows = result.rows
    if not export_complete(
        export_id=record.pk, epoch=epoch, key=key, rows=result.rows,
        byte_size=result.byte_size, checksum=result.sha256,
        retention_days=record.account.export_retention_days or settings.FAIRSHARE["EXPORT_RETENTION_DAYS"],
    ):
        raise lost_ownership_error(export_id=record.pk, epoch=epoch)
    return outcome, result.rows


def _record_failure(attempt: ExportAttempt, *, rows: int, error: BaseException) -> None:
    """Record a failed attempt and give its claim back, so that a retry can claim it at once."""
    for reconnect in (False, True):
        try:
            if reconnect:
                # The failure may have been this worker's database connection dropping: Django
                # keeps a broken connection until it is closed; the next query reconnects.
                close_old_connections()
            _attempt_finish(attempt, outcome=AttemptOutcome.FAILED, rows=rows, error=error)
            export_unclaim(export_id=attempt.export_id, epoch=attempt.epoch)
            return
        except Exception:
            pass
    # The database is still away. The record keeps its lease, which expires, and the reconciler
    # sends it again; the original error is what we report.
    logger.warning("could not record the failure of export %s", attempt.export_id)


def _build_and_publish(record: ExportRecord, *, key: str, meter: Meter, on_batch, checkpoint) -> storage.Manifest:
    since, until = day_bounds(record.start_date, record.end_date)
    with storage.staging_file() as tmp:
        result = stream_csv(
            source=get_source(record.source), account_id=record.account_id, since=since, until=until,
            out=tmp, meter=meter, on_batch=on_batch,
        )
        tmp.flush()
        manifest = storage.Manifest(export_id=str(record.pk), sha256=result.sha256, rows=result.rows,
                                    byte_size=result.byte_size)
        # Fence before the side effect: don't publish for an attempt that lost its lease.
        checkpoint(result.rows)
        storage.publish(key=key, fileobj=tmp, manifest=manifest, meter=meter)
    return manifest
