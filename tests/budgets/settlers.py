"""A child process for the ledger test: admits and settles runs with known meter figures.

Started with the `spawn` start method, so nothing Django is imported at module level: the child
points itself at the test database first (`env`), then sets Django up.
"""
import os


def meter_figures(worker: int, i: int) -> tuple[int, int, float, float]:
    """The (cpu_ms, wall_ms, db_wait_ms, storage_wait_ms) run `i` of `worker` reports.

    The waits are fractional, as measured waits are, so the ledger's rounding is exercised.
    """
    n = worker * 1000 + i
    return n % 97 + 1, n % 211 + 5, (n % 13) * 0.75, (n % 7) * 1.5


def settle_runs(env: dict[str, str], worker: int, runs: int, account_id: int, together) -> None:
    os.environ.update(env)
    import django

    django.setup()
    from django.db import connections

    from scheduling.metering import Meter
    from budgets.admission import admit
    from budgets.settlement import settle
    from scheduling.envelope import Envelope

    together.wait(120)
    try:
        for i in range(runs):
            ref = f"{worker}-{i}"
            admission = admit(
                envelope=Envelope(job="tests.noop", account=account_id, ref=ref), queue="default",
                estimate_ms=10, worker=f"settler-{worker}",
            )
            if not admission.admitted:
                raise AssertionError(f"run {ref} was not admitted: {admission.reason}")
            cpu_ms, wall_ms, db_ms, storage_ms = meter_figures(worker, i)
            meter = Meter(cpu_ms=cpu_ms, wall_ms=wall_ms, db_wait_ms=db_ms, storage_wait_ms=storage_ms)
            meter._stopped = True  # fixed figures, as the budget middleware leaves them
            if not settle(slot_id=admission.slot_id, account_id=account_id, queue="default", meter=meter):
                raise AssertionError(f"run {ref} was not settled")
    finally:
        connections.close_all()
