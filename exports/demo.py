"""The demo's generated workload (`manage.py demo_workload`, started by `scripts/demo`): within a
minute the dashboard and the fair-share view show fair share happening.

- `globex` floods: hundreds of short jobs at once, and more every FLOOD_EVERY_S: most wait in the
  holding area at its cap of concurrent jobs and are worked off as its slots free,
- `initech` is light: one short job every LIGHT_EVERY_S, which runs at once beside the flood,
- `umbrella` hits its CPU cap: a daily budget of CAPPED_CPU_S CPU seconds, spent within a minute,
  after which its jobs wait ("daily CPU budget exhausted") for the next budget day,
- `acme` runs a recurring export: one every EXPORT_EVERY_S on the exports queue,
- failures, every FAILURES_EVERY_S, classified as any job's are (scheduling/retries.py), so an
  operator sees each kind in the admin and on the dashboard without making one: `demo.flaky` fails
  its first attempt with a dropped connection (transient: held for its back-off, then it runs
  again and succeeds), `demo.broken` fails with an error no retry can mend (terminal: failed at
  once), and one of acme's exports meets a transient storage error while it publishes
  (`HiccupStorage`, the demo's export storage): its attempt fails, and the export is retried and
  completes.

The main job, `demo.work`, burns the CPU its ref names ("<ms>/<id>", identifiers only like every
envelope) in slices, checking its budget between them like a well-behaved long job. It is
registered only where this module is loaded (FAIRSHARE_EXTRA_JOB_MODULES=exports.demo, which
`scripts/demo` sets for every process).
"""
import datetime as dt
import errno
import itertools
import re
import time
import uuid

from django.contrib.auth import get_user_model
from django.core.files.storage import FileSystemStorage
from django.db import transaction
from django.utils import timezone

from budgets.models import Account, Budget, Membership, Plan, Role
from budgets.plans import budgets_ensure_defaults
from exports.models import ExportRecord
from exports.requests import export_request
from scheduling.registry import job
from scheduling.retries import RetryPolicy
from scheduling.runtime import enqueue, enqueue_many
from scheduling.services import retries_so_far

JOB = "demo.work"
FLOOD, LIGHT, CAPPED, EXPORTER = "globex", "initech", "umbrella", "acme"
FLOOD_JOBS, FLOOD_MORE, FLOOD_EVERY_S, FLOOD_MS = 240, 60, 30, 150
LIGHT_EVERY_S, LIGHT_MS = 2, 100
CAPPED_EVERY_S, CAPPED_MS, CAPPED_CPU_S = 2, 400, 6
EXPORT_EVERY_S, EXPORT_DAYS = 30, 7
# The failures: a job that fails once, one that fails for good, an export that meets a storage error.
FLAKY_JOB, BROKEN_JOB = "demo.flaky", "demo.broken"
FAILURES_EVERY_S, FLAKY_AT_S, BROKEN_AT_S, HICCUP_AT_S = 60, 3, 5, 7
HICCUP_KEY = "demo-storage-hiccup-"  # the idempotency key of an export whose first publish fails


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


@job(FLAKY_JOB, cpu_estimate_ms=50, retry=RetryPolicy(max_attempts=3, base_s=1, cap_s=5))
def flaky(ctx) -> None:
    """Fails its first attempt as a dropped connection does (a ConnectionError: transient, so the
    retry middleware holds it for its back-off), and succeeds when it runs again."""
    if retries_so_far(job=FLAKY_JOB, ref=ctx.envelope.ref) == 0:
        raise ConnectionResetError(errno.ECONNRESET, "demo: the upstream service reset the connection (retried)")
    ctx.items = 1


@job(BROKEN_JOB, cpu_estimate_ms=50)
def broken(ctx) -> None:
    """Fails for good: a ValueError is no failure a retry can mend (terminal, scheduling/retries.py)."""
    raise ValueError("demo: the report template names a column the report does not have (not retried)")


class HiccupStorage(FileSystemStorage):
    """The demo's export storage (`scripts/demo` sets FAIRSHARE_EXPORTS_STORAGE_BACKEND to it):
    local files, except that the first attempt at publishing an export the workload requested
    with a HICCUP_KEY idempotency key fails as an object store that dropped the connection fails
    (a ConnectionError: transient). The export's attempt is recorded as failed, and the export is
    retried after its back-off and completes. Every other export is stored as usual."""

    _EXPORT_FILE = re.compile(r"/([0-9a-f-]{36})\.csv$")

    def _save(self, name, content):
        found = self._EXPORT_FILE.search(name)
        if found and ExportRecord.objects.filter(pk=found[1], idempotency_key__startswith=HICCUP_KEY,
                                                 attempt_count__lte=1).exists():
            raise ConnectionResetError(errno.ECONNRESET, "demo: the object store reset the connection while the "
                                                         "export was published (retried)")
        return super()._save(name, content)


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


def request_export(account: Account, *, slot: int, key: str = "demo-recurring-") -> ExportRecord:
    """The recurring export: the last EXPORT_DAYS days, once per slot (its idempotency key, which
    starts with `key`: HICCUP_KEY for one whose first publish fails)."""
    owner = (Membership.objects.filter(account=account, role=Role.OWNER).select_related("user").first())
    user = owner.user if owner else get_user_model().objects.filter(is_superuser=True).first()
    today = timezone.now().date()
    record, _ = export_request(account_slug=account.slug, user=user, start=today - dt.timedelta(days=EXPORT_DAYS),
                               end=today, idempotency_key=f"{key}{today.isoformat()}-{slot}")
    return record


def fail_on_purpose(accounts: dict[str, Account], second: int) -> list[str]:
    """The workload's failures, FAILURES_EVERY_S apart (module docstring); returns what it did."""
    done = []
    at = second % FAILURES_EVERY_S
    if at == FLAKY_AT_S:
        enqueue(job=FLAKY_JOB, account=accounts[LIGHT].pk, ref=uuid.uuid4().hex[:12])
        done.append(f"{LIGHT}: a job that fails once, then succeeds ({FLAKY_JOB})")
    if at == BROKEN_AT_S:
        enqueue(job=BROKEN_JOB, account=accounts[LIGHT].pk, ref=uuid.uuid4().hex[:12])
        done.append(f"{LIGHT}: a job that fails for good ({BROKEN_JOB})")
    if at == HICCUP_AT_S:
        request_export(accounts[EXPORTER], slot=int(time.time()) // FAILURES_EVERY_S, key=HICCUP_KEY)
        done.append(f"{EXPORTER}: an export that meets a storage error and is retried")
    return done


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
    return done + fail_on_purpose(accounts, second)


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
