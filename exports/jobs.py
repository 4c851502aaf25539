"""Export jobs: thin adapters from an envelope to the export services."""
from uuid import UUID

from exports import services
from scheduling.envelope import ContractError
from scheduling.registry import job
from scheduling.services import worker_id


@job(services.BUILD_JOB, queue="exports", cpu_estimate_ms=2000)
def build(ctx) -> None:
    try:
        export_id = UUID(ctx.envelope.ref)
    except ValueError:
        raise ContractError("exports.build needs an export id as its ref") from None
    result = services.export_build(
        export_id=export_id, account_id=ctx.envelope.account, owner=worker_id(), meter=ctx.meter, task_run=ctx.run,
        budget=ctx.budget,
    )
    ctx.items = result.rows
    ctx.outcome = result.outcome
