"""Demo data: three accounts, their people, budgets and activity. Safe to run again."""
import datetime as dt

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone
from tqdm import tqdm

from budgets.models import Account, ApiToken, Membership, Plan, Role
from budgets.plans import budgets_ensure_defaults
from exports.models import ActivityEvent
from exports.sample_data import add_activity

ACCOUNTS = [
    ("acme", "Acme Corporation", Plan.ENTERPRISE),
    ("globex", "Globex", Plan.STANDARD),
    ("initech", "Initech", Plan.FREE),
]
OPERATOR_GROUP = "Account operators"
OPERATOR_PERMISSIONS = [
    "view_account", "view_membership", "view_budget", "view_exportrecord", "view_exportattempt",
    "view_activityevent", "view_taskrun",
]
SPAN = dt.timedelta(days=90)


class Command(BaseCommand):
    help = (
        "Create the demo accounts (acme, globex, initech), an owner and an operator per account, "
        "a demo superuser, default budgets and --rows activity rows per account over the last "
        "90 days. Idempotent: running it again tops up to the same state."
    )

    def add_arguments(self, parser):
        parser.add_argument("--rows", type=int, default=1000, help="activity rows per account (default 1000)")
        parser.add_argument("--admin-password", default="fairshare-demo", help="password of every demo user")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")

    def handle(self, *, rows, admin_password, no_progress, **options):
        User = get_user_model()
        group = self._operator_group()
        admin, _ = User.objects.get_or_create(username="admin", defaults={"email": "admin@example.com"})
        admin.is_staff = admin.is_superuser = True
        admin.set_password(admin_password)
        admin.save()

        for slug, name, plan in ACCOUNTS:
            with transaction.atomic():
                account, _ = Account.objects.get_or_create(slug=slug, defaults={"name": name, "plan": plan})
                budgets_ensure_defaults(account=account)
                for role in (Role.OWNER, Role.OPERATOR):
                    user, _ = User.objects.get_or_create(
                        username=f"{slug}-{role}", defaults={"email": f"{role}@{slug}.example", "is_staff": True},
                    )
                    user.set_password(admin_password)
                    user.save()
                    user.groups.add(group)
                    Membership.objects.get_or_create(user=user, account=account, defaults={"role": role})
            self._activity(account, rows, show_progress=not no_progress)

        token_line = self._demo_token()
        self.stdout.write(self.style.SUCCESS("Demo data ready."))
        self.stdout.write(f"  superuser: admin / {admin_password}")
        self.stdout.write(f"  per account (acme, globex, initech): <slug>-owner, <slug>-operator / {admin_password}")
        if token_line:
            self.stdout.write(token_line)

    def _operator_group(self) -> Group:
        group, _ = Group.objects.get_or_create(name=OPERATOR_GROUP)
        group.permissions.set(Permission.objects.filter(codename__in=OPERATOR_PERMISSIONS))
        return group

    def _activity(self, account: Account, rows: int, *, show_progress: bool) -> None:
        existing = ActivityEvent.objects.filter(account=account).count()
        missing = max(0, rows - existing)
        if not missing:
            return
        # Rows existing+1 … rows of the account's series: the same command makes the same data
        # everywhere, and a top-up adds to what is there without replacing it.
        with tqdm(total=missing, desc=f"activity {account.slug}", unit="rows", disable=not show_progress) as bar:
            add_activity(account, missing, since=timezone.now() - SPAN, span_s=SPAN.total_seconds(),
                         first=existing, on_batch=bar.update)

    def _demo_token(self) -> str:
        """A fresh token on every run: only its hash is kept, so the one an earlier run printed
        cannot be shown again. The earlier demo tokens stay valid until revoked in the admin."""
        owner = get_user_model().objects.get(username="acme-owner")
        earlier = ApiToken.objects.filter(user=owner, name__startswith="demo", revoked_at__isnull=True).count()
        _, raw = ApiToken.issue(user=owner, account=Account.objects.get(slug="acme"), name=f"demo {earlier + 1}")
        note = f"\n  ({earlier} earlier demo token(s) still valid: API tokens in the admin)" if earlier else ""
        return f"  API token for acme-owner (shown once): {raw}{note}"
