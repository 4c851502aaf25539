"""The rehearsal's fixed inputs: the plan, the dedicated account with its rows, the backlog, and a
clean slate before every round."""
import datetime as dt
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.core.files.storage import FileSystemStorage
from django.db import connection, transaction
from django_q.models import OrmQ
from django_q.signing import SignedPackage

from budgets.models import Account, Budget, Membership, Plan, Queue, Reservation, Role, UsageDay
from exports import storage
from exports.models import ActivityEvent, ExportRecord
from exports.sample_data import add_activity
from scheduling import processes
from scheduling.models import DeferredTask, TaskRun

ACCOUNT_SLUG = "rehearsal"
USERNAME = "rehearsal-owner"
SMALL_JOB = "scheduling.noop"
DEFAULT_QUEUE_WORKERS = 2
# The activity spans the 90 days up to a fixed date, so every run exports the same rows.
LAST_DAY = dt.date(2025, 12, 31)
SPAN_DAYS = 90
# Export i covers the last 30, 60 or 90 days of it: a mix of sizes, the same in every round.
EXPORT_SPANS_DAYS = (30, 60, 90)


class RehearsalError(Exception):
    pass


@dataclass(frozen=True)
class RehearsalPlan:
    concurrencies: tuple[int, ...]
    exports: int
    small_jobs: int
    rows: int
    timeout_s: float = 600


def ensure_account(*, rows: int, max_concurrency: int) -> tuple[Account, object]:
    """The rehearsal account, its owner, budgets that never limit it, and exactly `rows` rows."""
    User = get_user_model()
    with transaction.atomic():
        account, _ = Account.objects.get_or_create(
            slug=ACCOUNT_SLUG, defaults={"name": "Capacity rehearsal", "plan": Plan.ENTERPRISE})
        user, _ = User.objects.get_or_create(username=USERNAME, defaults={"email": "rehearsal@example.invalid"})
        Membership.objects.get_or_create(user=user, account=account, defaults={"role": Role.OWNER})
        # Budgets must not be what limits a round: a huge daily allowance, and slots to spare
        # (a duplicate delivery briefly takes a slot too).
        slots = 2 * max(max_concurrency, DEFAULT_QUEUE_WORKERS)
        for queue in Queue.values:
            Budget.objects.update_or_create(account=account, queue=queue, defaults={
                "cpu_seconds_per_day": 1_000_000_000, "max_concurrent": slots})
    if ActivityEvent.objects.filter(account=account).count() != rows:
        _seed_activity(account, rows)
    return account, user


def _seed_activity(account: Account, rows: int) -> None:
    first = dt.datetime.combine(LAST_DAY - dt.timedelta(days=SPAN_DAYS - 1), dt.time.min, tzinfo=dt.UTC)
    with transaction.atomic():
        ActivityEvent.objects.filter(account=account).delete()
        add_activity(account, rows, since=first, span_s=SPAN_DAYS * 24 * 3600)
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE exports_activityevent")


def reset(account: Account) -> None:
    """Forget the previous round: the account's exports (and files), runs, held work, usage and
    any message of it still in the broker."""
    for export_id in ExportRecord.objects.filter(account=account).values_list("pk", flat=True):
        storage.delete(key=storage.object_key(account_id=account.pk, export_id=export_id))
    with transaction.atomic():
        ExportRecord.objects.filter(account=account).delete()
        TaskRun.objects.filter(account=account).delete()
        DeferredTask.objects.filter(account=account).delete()
        Reservation.objects.filter(account=account).delete()
        UsageDay.objects.filter(account=account).delete()
        _delete_queued_messages(account)


def _delete_queued_messages(account: Account) -> None:
    stale = []
    for pk, payload in OrmQ.objects.filter(key__in=Queue.values).values_list("pk", "payload"):
        try:
            message = SignedPackage.loads(payload)["args"][0]
        except Exception:
            continue
        if isinstance(message, dict) and message.get("account") == account.pk:
            stale.append(pk)
    OrmQ.objects.filter(pk__in=stale).delete()


def backlog(n_exports: int, n_small: int) -> list[tuple[str, int]]:
    """The same traffic every round: the exports first (the backlog being measured), then the small
    jobs, which arrive while the exports run, like API traffic competing for the same host."""
    return [("export", i) for i in range(n_exports)] + [("small", j) for j in range(n_small)]


def export_scope(i: int) -> tuple[dt.date, dt.date]:
    days = EXPORT_SPANS_DAYS[i % len(EXPORT_SPANS_DAYS)]
    return LAST_DAY - dt.timedelta(days=days - 1), LAST_DAY


def worker_env(*, export_workers: int) -> dict[str, str]:
    """Workers of a round: `export_workers` on the exports queue, this process's export storage,
    and e-mail kept in memory, so nobody is notified."""
    env = processes.worker_env(
        FAIRSHARE_EXPORT_WORKERS=str(export_workers),
        FAIRSHARE_WORKERS=str(DEFAULT_QUEUE_WORKERS),
        EMAIL_BACKEND="django.core.mail.backends.locmem.EmailBackend",
    )
    exports_storage = storage.export_storage()
    if isinstance(exports_storage, FileSystemStorage):
        env["FAIRSHARE_EXPORTS_ROOT"] = str(exports_storage.location)
    return env
