"""The demo's generated workload (`manage.py demo_workload`, started by `scripts/demo`): within a
minute the dashboard and the fair-share view show fair share happening.

- `globex` floods: hundreds of short jobs at once, and more every FLOOD_EVERY_S: most wait in the
  holding area at its cap of concurrent jobs and are worked off as its slots free,
- `initech` is light: one short job every LIGHT_EVERY_S, which runs at once beside the flood,
- `umbrella` hits its CPU cap: a daily budget of CAPPED_CPU_S CPU seconds, spent within a minute,
  after which its jobs wait ("daily CPU budget exhausted") for the next budget day,
- `acme` runs a recurring export: one every EXPORT_EVERY_S on the exports queue.

The job, `demo.work`, burns the CPU its ref names ("<ms>/<id>", identifiers only like every
envelope) in slices, checking its budget between them like a well-behaved long job. It is
registered only where this module is loaded (FAIRSHARE_EXTRA_JOB_MODULES=exports.demo, which
`scripts/demo` sets for every process).
"""
import datetime as dt
import itertools
import time
import uuid

from django.contrib.auth import get_user_model
from django.db import transaction
from django.utils import timezone

from budgets.models import Account, Budget, Membership, Plan, Role
from budgets.plans import budgets_ensure_defaults
from exports.requests import export_request
from scheduling.registry import job
from scheduling.runtime import enqueue, enqueue_many

JOB = "demo.work"
FLOOD, LIGHT, CAPPED, EXPORTER = "globex", "initech", "umbrella", "acme"
FLOOD_JOBS, FLOOD_MORE, FLOOD_EVERY_S, FLOOD_MS = 240, 60, 30, 150
LIGHT_EVERY_S, LIGHT_MS = 2, 100
CAPPED_EVERY_S, CAPPED_MS, CAPPED_CPU_S = 2, 400, 6
EXPORT_EVERY_S, EXPORT_DAYS = 30, 7


@job(JOB, cpu_estimate_ms=100)
def work(ctx) -> None:
    """Burns the CPU milliseconds its ref names, checking its budget every 50 ms."""
    end = time.process_time() + int(ctx.envelope.ref.split("/", 1)[0]) / 1000
    n = 0
    while time.process_time() < end:
        slice_end = min(end, time.process_time() + 0.05)
        while time.process_time() < slice_end:
            n += 1
        ctx.budget.check()
    ctx.items = n


def ensure_accounts() -> dict[str, Account]:
    """The workload's accounts, as seed_demo leaves them, plus `umbrella` with its small CPU budget
    on the default queue (set again on every start: the cap is what the demo shows)."""
    accounts = {}
    for slug, plan in ((FLOOD, Plan.STANDARD), (LIGHT, Plan.FREE), (CAPPED, Plan.FREE), (EXPORTER, Plan.ENTERPRISE)):
        with transaction.atomic():
            account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": slug.title(), "plan": plan})
            budgets_ensure_defaults(account=account)
        accounts[slug] = account
    Budget.objects.filter(account=accounts[CAPPED], queue="default").update(cpu_seconds_per_day=CAPPED_CPU_S)
    return accounts


def _refs(ms: int, n: int) -> list[str]:
    return [f"{ms}/{uuid.uuid4().hex[:12]}" for _ in range(n)]


def flood(account: Account, n: int) -> int:
    """`n` short jobs for the flooding account at once; returns how many were held."""
    sent = enqueue_many(job=JOB, work=[(account.pk, ref) for ref in _refs(FLOOD_MS, n)])
    return sum(1 for task_id in sent if task_id is None)


def request_export(account: Account, *, slot: int) -> None:
    """The recurring export: the last EXPORT_DAYS days, once per slot (its idempotency key)."""
    owner = (Membership.objects.filter(account=account, role=Role.OWNER).select_related("user").first())
    user = owner.user if owner else get_user_model().objects.filter(is_superuser=True).first()
    today = timezone.now().date()
    export_request(account_slug=account.slug, user=user, start=today - dt.timedelta(days=EXPORT_DAYS), end=today,
                   idempotency_key=f"demo-recurring-{today.isoformat()}-{slot}")


def step(accounts: dict[str, Account], second: int) -> list[str]:
    """What the workload does at `second` since it started; returns what it did, for its log."""
    done = []
    if second == 0:
        done.append(f"{FLOOD}: {FLOOD_JOBS} jobs, {flood(accounts[FLOOD], FLOOD_JOBS)} held")
    elif second % FLOOD_EVERY_S == 0:
        done.append(f"{FLOOD}: {FLOOD_MORE} more jobs, {flood(accounts[FLOOD], FLOOD_MORE)} held")
    if second % LIGHT_EVERY_S == 0:
        enqueue(job=JOB, account=accounts[LIGHT].pk, ref=_refs(LIGHT_MS, 1)[0])
    if second % CAPPED_EVERY_S == 1:
        enqueue(job=JOB, account=accounts[CAPPED].pk, ref=_refs(CAPPED_MS, 1)[0])
    if second % EXPORT_EVERY_S == 0:
        request_export(accounts[EXPORTER], slot=int(time.time()) // EXPORT_EVERY_S)
        done.append(f"{EXPORTER}: recurring export requested")
    return done


def run(*, duration_s: float | None = None, log=print) -> None:
    """The workload, one step a second, for `duration_s` (None: until stopped)."""
    accounts = ensure_accounts()
    start = time.monotonic()
    for second in itertools.count():
        if duration_s is not None and second >= duration_s:
            return
        for line in step(accounts, second):
            log(line)
        time.sleep(max(0.0, start + second + 1 - time.monotonic()))
