"""Export jobs: thin adapters from an envelope to the export services."""
from uuid import UUID

from exports.build import export_build
from exports.leases import export_give_up
from exports.maintenance import purge_expired_exports, reconcile_exports
from exports.recurring import run_export_schedules
from exports.requests import BUILD_JOB
from scheduling.envelope import ContractError
from scheduling.registry import job
from scheduling.retries import RetryPolicy
from scheduling.services import worker_id


def _export_id(ctx) -> UUID:
    try:
        return UUID(ctx.envelope.ref)
    except ValueError:
        raise ContractError("exports.build needs an export id as its ref") from None


def _give_up(ctx, exc: BaseException) -> None:
    export_give_up(export_id=_export_id(ctx), error=exc)


@job(BUILD_JOB, queue="exports", cpu_estimate_ms=2000,
     retry=RetryPolicy(max_attempts=5, base_s=2, cap_s=120), on_give_up=_give_up)
def build(ctx) -> None:
    result = export_build(
        export_id=_export_id(ctx), account_id=ctx.envelope.account, owner=worker_id(), meter=ctx.meter,
        task_run=ctx.run, budget=ctx.budget,
    )
    ctx.items = result.rows
    ctx.outcome = result.outcome


@job("exports.reconcile", account_scoped=False)
def reconcile(ctx) -> None:
    """Re-send exports whose doorbell was lost (broker message gone, worker killed)."""
    ctx.items = reconcile_exports()


@job("exports.run_schedules", account_scoped=False)
def run_schedules(ctx) -> None:
    """Request the due period of every recurring export (one export per period, however often it fires)."""
    ctx.items = run_export_schedules()


@job("exports.purge_expired", account_scoped=False)
def purge_expired(ctx) -> None:
    """Delete exports past their retention, and their files."""
    ctx.items = purge_expired_exports()
