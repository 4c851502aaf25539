"""Tenant isolation in the admin (SPEC §4 Operators, issue 11): staff of account "acme" try every
way into account "globex"'s records - change lists, list filters, form choices, submitted ids,
actions and object URLs - for every admin model, django-q2's included. As viewer, operator and
owner with every model permission, and as an owner holding each single permission: every attempt
is refused (404 like a missing object, 403, or an invalid form), globex's name never shows, and
the database is unchanged."""
import datetime as dt
from types import SimpleNamespace

import pytest
from django.apps import apps
from django.contrib.auth.models import Group, Permission
from django.utils import timezone
from django_q.models import OrmQ, Task

from budgets.models import ApiToken, Budget, Reservation, Role, UsageDay
from exports.models import ExportRecord, ExportSchedule
from scheduling.models import DeferredTask, TaskRun, TaskRunDaily, WorkerHeartbeat
from scheduling.runtime import send
from tasks.models import TaskCall
from tests.factories import AccountFactory, ActivityEventFactory, MembershipFactory, UserFactory

pytestmark = pytest.mark.django_db

NOW = dt.datetime(2026, 3, 3, tzinfo=dt.UTC)

# Every admin page of a model that holds tenant data or platform state.
ADMIN_MODELS = [
    "budgets/account", "budgets/membership", "budgets/budget", "budgets/apitoken", "budgets/usageday",
    "budgets/reservation", "exports/exportrecord", "exports/activityevent", "exports/exportschedule",
    "scheduling/taskrun", "scheduling/deferredtask", "scheduling/taskrundaily", "scheduling/workerheartbeat",
    "django_q/success", "django_q/failure", "django_q/schedule", "django_q/ormq", "auth/user", "auth/group",
    "tasks/taskcall",
]
ACTIONS = ["delete_selected", "cancel", "release", "revoke", "retry"]


def _model(label: str):
    return apps.get_model(*label.split("/"))


def _permissions() -> list[str]:
    """app_label.codename of every permission of every admin model."""
    perms = []
    for label in ADMIN_MODELS:
        model = _model(label)
        perms += [f"{model._meta.app_label}.{action}_{model._meta.model_name}"
                  for action in ("view", "add", "change", "delete")]
    return perms


@pytest.fixture
def world():
    """acme (the actors' account) and globex (the target), each with a record of every kind."""
    acme, globex = AccountFactory(slug="acme"), AccountFactory(slug="globex")
    MembershipFactory(account=acme, user=UserFactory(username="acme-boss"), role=Role.OWNER)
    b_owner = MembershipFactory(account=globex, user=UserFactory(username="globex-owner"), role=Role.OWNER)
    b = SimpleNamespace(account=globex, owner=b_owner.user, membership=b_owner)
    b.budget = Budget.objects.create(account=globex, queue="default", cpu_seconds_per_day=60, max_concurrent=2)
    b.token, _ = ApiToken.issue(user=b.owner, account=globex, name="globex-ci")
    b.usage = UsageDay.objects.create(account=globex, queue="default", day=NOW.date())
    b.reservation = Reservation.objects.create(account=globex, queue="default", day=NOW.date(), job="globex.job",
                                               ref="globex-ref", lease_expires_at=NOW)
    b.export = ExportRecord.objects.create(account=globex, requested_by=b.owner, start_date=NOW.date(),
                                           end_date=NOW.date(), source="activity", idempotency_key="globex-key")
    b.event = ActivityEventFactory(account=globex, actor_email="ceo@globex.example")
    b.schedule = ExportSchedule.objects.create(account=globex, requested_by=b.owner)
    b.run = TaskRun.objects.create(account=globex, job="globex.job", ref="globex-ref", started_at=NOW,
                                   error_message="globex failure")
    b.deferred = DeferredTask.objects.create(account=globex, queue="default", job="tests.noop", ref="globex-held",
                                             reason="retry_backoff", eligible_at=NOW)
    b.daily = TaskRunDaily.objects.create(account=globex, day=NOW.date(), job="globex.job", queue="default",
                                          outcome="failed")
    b.heartbeat = WorkerHeartbeat.objects.create(worker="globex-host:1", queue="default", seen_at=NOW)
    b.failure = Task.objects.create(id="f" * 32, name="globex.job:failed", func="scheduling.runtime.execute",
                                    group=f"account-{globex.pk}", started=NOW, stopped=NOW, success=False,
                                    result="globex traceback")
    b.success = Task.objects.create(id="s" * 32, name="globex.job:done", func="scheduling.runtime.execute",
                                    group=f"account-{globex.pk}", started=NOW, stopped=NOW, success=True)
    send(job="tests.noop", account=globex.pk, ref="globex-queued")
    b.ormq = OrmQ.objects.get()
    b.group = Group.objects.create(name="globex-admins")
    b.call = TaskCall.objects.create(account=globex, backend="default", task_path="tests.tasks.functions.noop",
                                     queue="default", arguments={"args": ["globex secret"], "kwargs": {}},
                                     enqueued_at=NOW, sent_at=NOW)
    objects = {
        "budgets/account": globex, "budgets/membership": b_owner, "budgets/budget": b.budget,
        "budgets/apitoken": b.token, "budgets/usageday": b.usage, "budgets/reservation": b.reservation,
        "exports/exportrecord": b.export, "exports/activityevent": b.event, "exports/exportschedule": b.schedule,
        "scheduling/taskrun": b.run, "scheduling/deferredtask": b.deferred, "scheduling/taskrundaily": b.daily,
        "scheduling/workerheartbeat": b.heartbeat, "django_q/success": b.success, "django_q/failure": b.failure,
        "django_q/schedule": __import__("django_q.models").models.Schedule.objects.first()
        or __import__("django_q.models").models.Schedule.objects.create(name="globex-cron", func="x"),
        "django_q/ormq": b.ormq, "auth/user": b.owner, "auth/group": b.group, "tasks/taskcall": b.call,
    }
    return SimpleNamespace(acme=acme, b=b, objects=objects)


def _add_payloads(b) -> dict[str, dict]:
    """Add-form submissions that point at globex's ids (the form must refuse them)."""
    return {
        "budgets/membership": {"user": b.owner.pk, "account": b.account.pk, "role": "owner"},
        "budgets/budget": {"account": b.account.pk, "queue": "exports", "cpu_seconds_per_day": 9,
                           "max_concurrent": 9},
        "budgets/apitoken": {"account": b.account.pk, "name": "stolen"},
        "exports/activityevent": {"account": b.account.pk, "occurred_at_0": "2026-03-01", "occurred_at_1": "10:00",
                                  "actor_email": "x@acme.example", "event_type": "planted", "amount": "1"},
        "exports/exportschedule": {"account": b.account.pk, "requested_by": b.owner.pk, "source": "activity",
                                   "format": "csv", "period": "daily", "at_time": "01:00", "is_active": "on"},
    }


def _dump() -> dict:
    """Every row of every admin model (last_login aside: logging in writes it)."""
    return {label: [{k: v for k, v in row.items() if k != "last_login"}
                    for row in _model(label)._default_manager.order_by("pk").values()]
            for label in ADMIN_MODELS + ["django_q/task"]}


def _actor(account, role: str, perms: list[str]):
    user = UserFactory(username=f"acme-{role}-{len(perms)}-{perms[0].replace('.', '-')}", is_staff=True)
    MembershipFactory(account=account, user=user, role=role)
    for perm in perms:
        app_label, codename = perm.split(".")
        user.user_permissions.add(Permission.objects.get(content_type__app_label=app_label, codename=codename))
    return user


def _try_everything(client, world, label: str) -> None:
    b, target = world.b, world.objects[label]
    base = f"/admin/{label}/"
    for url in [base, f"{base}?account__id__exact={b.account.pk}", f"{base}add/"]:
        response = client.get(url)
        assert response.status_code in (200, 302, 403), url
        if response.status_code == 200:
            assert "globex" not in response.content.decode(), f"globex shows on {url}"
    search = client.get(f"{base}?q=globex")  # the page echoes the query: look for the record instead
    assert f"{base}{target.pk}/change/" not in search.content.decode()
    for suffix in ("change/", "delete/", "history/"):
        response = client.get(f"{base}{target.pk}/{suffix}")
        assert response.status_code in (403, 404), f"{label} {suffix}: {response.status_code}"
    assert client.post(f"{base}{target.pk}/change/", {"name": "changed"}).status_code in (403, 404)
    payload = _add_payloads(b).get(label)
    if payload is not None:
        response = client.post(f"{base}add/", payload)
        assert response.status_code in (200, 403), f"{label} add: {response.status_code}"  # 200: form errors
    for action in ACTIONS:
        client.post(base, {"action": action, "_selected_action": [str(target.pk)], "post": "yes"})


ROLES = [Role.VIEWER, Role.OPERATOR, Role.OWNER]


@pytest.mark.parametrize("label", ADMIN_MODELS)
@pytest.mark.parametrize("role", ROLES)
def test_every_role_with_every_permission_is_refused_another_accounts_records(client, world, role, label):
    client.force_login(_actor(world.acme, role, _permissions()))
    before = _dump()
    _try_everything(client, world, label)
    assert _dump() == before


@pytest.mark.parametrize("perm", _permissions())
def test_staff_with_each_single_permission_is_refused_another_accounts_records(client, world, perm):
    label = next(label for label in ADMIN_MODELS if perm.endswith(f"_{_model(label)._meta.model_name}")
                 and perm.startswith(f"{_model(label)._meta.app_label}."))
    client.force_login(_actor(world.acme, Role.OWNER, [perm]))
    before = _dump()
    _try_everything(client, world, label)
    assert _dump() == before


def test_a_superuser_sees_across_accounts(client, world):
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    for label in ADMIN_MODELS:
        response = client.get(f"/admin/{label}/{world.objects[label].pk}/change/")
        assert response.status_code == 200, label
    assert "globex traceback" in client.get(f"/admin/django_q/failure/{world.b.failure.pk}/change/").content.decode()
    # ...and django-q2's "resubmit" is gone for everyone.
    page = client.get("/admin/django_q/failure/").content.decode()
    assert "resubmit" not in page.lower()


def test_own_records_stay_visible_and_the_filter_offers_only_own_accounts(client, world):
    own = ExportRecord.objects.create(account=world.acme, start_date=NOW.date(), end_date=NOW.date(),
                                      source="activity")
    client.force_login(_actor(world.acme, Role.VIEWER, ["exports.view_exportrecord"]))
    page = client.get("/admin/exports/exportrecord/").content.decode()
    assert str(own.pk) in page and "acme" in page and "globex" not in page
    assert client.get(f"/admin/exports/exportrecord/{own.pk}/change/").status_code == 200


def test_a_viewer_cannot_release_held_work_and_an_operator_can(client, world):
    held = DeferredTask.objects.create(account=world.acme, queue="default", job="tests.noop", ref="acme-held",
                                       reason="retry_backoff", eligible_at=NOW)
    perms = ["scheduling.view_deferredtask", "scheduling.change_deferredtask"]
    client.force_login(_actor(world.acme, Role.VIEWER, perms))
    client.post("/admin/scheduling/deferredtask/", {"action": "release", "_selected_action": [held.pk]})
    assert DeferredTask.objects.filter(pk=held.pk).exists()

    client.force_login(_actor(world.acme, Role.OPERATOR, perms))
    client.post("/admin/scheduling/deferredtask/", {"action": "release", "_selected_action": [held.pk]})
    assert not DeferredTask.objects.filter(pk=held.pk).exists()


def test_an_owner_adds_members_to_their_own_account_only(client, world):
    newcomer = MembershipFactory(account=world.acme, user=UserFactory(username="acme-new"), role=Role.VIEWER).user
    owner = _actor(world.acme, Role.OWNER, ["budgets.view_membership", "budgets.change_membership",
                                            "budgets.add_membership"])
    client.force_login(owner)
    membership = newcomer.memberships.get()
    response = client.post(f"/admin/budgets/membership/{membership.pk}/change/",
                           {"user": newcomer.pk, "account": world.acme.pk, "role": "operator"})
    assert response.status_code == 302
    assert newcomer.memberships.get().role == Role.OPERATOR

    operator = _actor(world.acme, Role.OPERATOR, ["budgets.view_membership", "budgets.change_membership"])
    client.force_login(operator)
    response = client.post(f"/admin/budgets/membership/{membership.pk}/change/",
                           {"user": newcomer.pk, "account": world.acme.pk, "role": "owner"})
    assert response.status_code == 403
    assert newcomer.memberships.get().role == Role.OPERATOR


def test_an_api_token_is_shown_once_to_the_person_it_belongs_to_and_revoked_not_deleted(client, world):
    user = _actor(world.acme, Role.VIEWER, ["budgets.view_apitoken", "budgets.add_apitoken",
                                            "budgets.change_apitoken"])
    client.force_login(user)
    response = client.post("/admin/budgets/apitoken/add/",
                           {"account": world.acme.pk, "name": "ci", "expires_at_0": "", "expires_at_1": ""},
                           follow=True)
    token = ApiToken.objects.get(name="ci")
    assert (token.user, token.account) == (user, world.acme)
    shown = [str(m) for m in response.context["messages"]]
    assert any("fs_" in m for m in shown)
    raw = next(m for m in shown if "fs_" in m).rsplit(" ", 1)[1]
    # Never again: not on its page, not in the admin log.
    assert raw not in client.get(f"/admin/budgets/apitoken/{token.pk}/change/").content.decode()
    from django.contrib.admin.models import LogEntry
    assert raw not in str(list(LogEntry.objects.values()))

    client.post("/admin/budgets/apitoken/", {"action": "revoke", "_selected_action": [token.pk]})
    token.refresh_from_db()
    assert token.revoked_at is not None and token.revoked_by == user
    assert ApiToken.objects.filter(pk=token.pk).exists()
    assert timezone.now() >= token.revoked_at
