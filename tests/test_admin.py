"""The operator UI: every model's admin renders, and staff see only their own accounts."""
import datetime as dt

import pytest
from django.contrib.auth.models import Permission
from django.urls import reverse

from budgets.models import Role
from exports.models import ExportAttempt, ExportRecord
from scheduling.models import TaskRun
from tests.factories import AccountFactory, ActivityEventFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def export(account, owner):
    record = ExportRecord.objects.create(
        account=account, requested_by=owner, start_date=dt.date(2026, 3, 1), end_date=dt.date(2026, 3, 2),
        source="activity", status="failed", error_class="ValueError", error_message="card ***",
    )
    run = TaskRun.objects.create(account=account, job="exports.build", ref=str(record.pk),
                                 started_at=dt.datetime(2026, 3, 3, tzinfo=dt.UTC), outcome="failed")
    ExportAttempt.objects.create(export=record, number=1, epoch=1, task_run=run, outcome="failed",
                                 error_class="ValueError", error_message="card ***")
    return record


def test_superuser_sees_every_admin_page(client, export, account):
    ActivityEventFactory(account=account)
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    for model in ["budgets/account", "budgets/membership", "budgets/budget", "budgets/apitoken",
                  "exports/exportrecord", "exports/activityevent", "scheduling/taskrun"]:
        assert client.get(f"/admin/{model}/").status_code == 200, model
    page = client.get(reverse("admin:exports_exportrecord_change", args=[export.pk]))
    assert page.status_code == 200
    # Attempts are inline, with their redacted error; nothing is editable.
    assert b"card ***" in page.content and b"ValueError" in page.content
    assert b'name="_save"' not in page.content
    filtered = client.get("/admin/exports/exportrecord/", {"status__exact": "failed", "account__id__exact": account.pk})
    assert str(export.pk) in filtered.content.decode()
    assert client.get(reverse("admin:exports_exportrecord_add")).status_code == 403
    assert client.get(reverse("admin:scheduling_taskrun_add")).status_code == 403


def test_staff_operator_sees_only_their_accounts_exports(client, export, account):
    other = ExportRecord.objects.create(account=AccountFactory(slug="globex"), start_date=dt.date(2026, 3, 1),
                                        end_date=dt.date(2026, 3, 1), source="activity")
    operator = MembershipFactory(account=account, role=Role.OPERATOR,
                                 user=UserFactory(username="acme-op", is_staff=True)).user
    operator.user_permissions.add(Permission.objects.get(codename="view_exportrecord"))
    client.force_login(operator)
    page = client.get("/admin/exports/exportrecord/").content.decode()
    assert str(export.pk) in page and str(other.pk) not in page
    # Another account's export is a 404, exactly like a missing one (issue 11: it was a redirect).
    assert client.get(reverse("admin:exports_exportrecord_change", args=[other.pk])).status_code == 404
