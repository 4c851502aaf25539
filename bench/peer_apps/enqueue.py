"""Enqueue N no-op jobs of one system, one call per job, for bench/peers.py.

    python bench/peer_apps/enqueue.py SYSTEM N      # in that system's interpreter

Run by bench/peers.py in the system's own interpreter (a peer's virtualenv, or the project's for
Fairshare's paths) with PEERS_DATABASE_URL set; prints {"jobs": N, "seconds": ...} on stdout (the
time of the N calls alone, after imports and set-up). `fairshare-setup` migrates the database and
creates the benchmark's accounts instead (bench/budget_overhead.py's, a second one like it for
`fairshare-tenants`, whose jobs alternate between the two, and one whose cap is the workers' number
for `fairshare-many`).

Fairshare's paths: chain, tenants (one `enqueue` per job), many and many-wide (one `enqueue_many`
of all N, for the account capped at the workers and for budget_overhead's, whose cap is far above
them), tasks (the Tasks API's `Task.enqueue`, one per job, for budget_overhead's account).
"""
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
SECOND_ACCOUNT = "bench-overhead-2"
CAPPED_ACCOUNT = "bench-capped"  # fairshare-many's: its cap is the number of workers
CAPPED_SLOTS = 2


def fairshare(path: str, n: int) -> float:
    sys.path.insert(0, str(REPO))
    from bench import budget_overhead as bo
    from bench import harness as h

    h.configure_environment(os.environ["PEERS_DATABASE_URL"], test_jobs=False)
    os.environ.update(json.loads(os.environ.get("PEERS_FAIRSHARE_BROKER") or "{}"))  # a path's broker (bench/peers.py)
    if path == "setup":
        h.migrate()
        h.setup_django()
        bo.setup_account()
        bo.setup_account(SECOND_ACCOUNT)
        from budgets.models import Budget

        Budget.objects.filter(account_id=bo.setup_account(CAPPED_ACCOUNT)).update(max_concurrent=CAPPED_SLOTS)
        return 0.0
    h.setup_django()
    from budgets.models import Account
    from django_q.tasks import async_task

    from scheduling.runtime import enqueue, enqueue_many

    account_id = Account.objects.get(slug=CAPPED_ACCOUNT if path == "many" else bo.ACCOUNT_SLUG).pk
    accounts = [account_id] + ([Account.objects.get(slug=SECOND_ACCOUNT).pk] if path == "tenants" else [])
    func = {"bare": bo.BARE_FUNC, "recorded": bo.RECORDED_FUNC}.get(path)
    if path in ("many", "many-wide"):  # one call for the flood
        t0 = time.perf_counter()
        enqueue_many(job=bo.CHAIN_JOB, work=[(account_id, f"peers-{i}") for i in range(n)])
        return time.perf_counter() - t0
    if path == "tasks":
        from bench.tasks_noop import noop

        t0 = time.perf_counter()
        for _ in range(n):
            noop.enqueue(account=account_id)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        if func:  # as bench/budget_overhead.py's bare and recorded paths
            async_task(func, bo.envelope_message(account_id, f"peers-{i}"), task_name=f"{func}:peers-{i}")
        else:  # sent, or held in the account's line while a job sent to the broker waits for a worker
            enqueue(job=bo.CHAIN_JOB, account=accounts[i % len(accounts)], ref=f"peers-{i}")
    return time.perf_counter() - t0


def procrastinate(n: int) -> float:
    from procrastinate_app import app, noop

    with app.open():
        t0 = time.perf_counter()
        for _ in range(n):
            noop.defer()
        return time.perf_counter() - t0


def django_tasks_db(n: int) -> float:
    import django

    django.setup()
    from dtdb_tasks import noop

    t0 = time.perf_counter()
    for _ in range(n):
        noop.enqueue()
    return time.perf_counter() - t0


def main() -> None:
    system, n = sys.argv[1], int(sys.argv[2])
    if system.startswith("fairshare-"):
        seconds = fairshare(system.removeprefix("fairshare-"), n)
    elif system == "procrastinate":
        seconds = procrastinate(n)
    elif system == "django-tasks-db":
        seconds = django_tasks_db(n)
    else:
        raise SystemExit(f"unknown system {system!r}")
    print(json.dumps({"jobs": n, "seconds": seconds}))


if __name__ == "__main__":
    main()
