"""`manage.py seed_demo`: the demo's accounts, people, budgets and data; safe to run again."""
import io
import re

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client

from budgets.models import Account, ApiToken, Budget, Membership, Role, hash_token
from exports.models import ActivityEvent

pytestmark = pytest.mark.django_db

SLUGS = ["acme", "globex", "initech"]


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    # seed_demo sets seven passwords per run; the production hasher takes ~1 s each.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def seed(**options) -> str:
    out = io.StringIO()
    call_command("seed_demo", no_progress=True, stdout=out, **options)
    return out.getvalue()


def state() -> dict:
    User = get_user_model()
    return {
        "accounts": sorted(Account.objects.values_list("slug", flat=True)),
        "users": sorted(User.objects.values_list("username", flat=True)),
        "memberships": sorted(Membership.objects.values_list("account__slug", "user__username", "role")),
        "budgets": sorted(Budget.objects.values_list("account__slug", "queue", "cpu_seconds_per_day",
                                                     "max_concurrent")),
        "activity": {slug: ActivityEvent.objects.filter(account__slug=slug).count() for slug in SLUGS},
        "tokens": ApiToken.objects.count(),
    }


def printed_admin_password(output: str) -> str:
    match = re.search(r"superuser: admin / (\S+)", output)
    assert match, output
    return match.group(1)


def test_seed_demo_creates_three_accounts_with_their_people_budgets_and_activity():
    output = seed(rows=50)

    s = state()
    assert s["accounts"] == SLUGS
    assert s["users"] == sorted(["admin"] + [f"{slug}-{role}" for slug in SLUGS for role in ("owner", "operator")])
    assert s["memberships"] == sorted(
        (slug, f"{slug}-{role}", role) for slug in SLUGS for role in (Role.OWNER, Role.OPERATOR)
    )
    queues = sorted(settings.FAIRSHARE["PLAN_BUDGETS"]["standard"])
    assert {(slug, queue) for slug, queue, *_ in s["budgets"]} == {(slug, q) for slug in SLUGS for q in queues}
    assert len(s["budgets"]) == len(SLUGS) * len(queues)
    assert s["activity"] == {slug: 50 for slug in SLUGS}
    assert "Demo data ready." in output


def test_budgets_follow_each_accounts_plan_tier():
    seed(rows=1)

    for account in Account.objects.all():
        for budget in account.budgets.all():
            limits = settings.FAIRSHARE["PLAN_BUDGETS"][account.plan][budget.queue]
            assert (budget.cpu_seconds_per_day, budget.max_concurrent) == (
                limits["cpu_seconds_per_day"], limits["max_concurrent"]), (account.slug, budget.queue)


def test_running_seed_demo_again_changes_nothing():
    first_output = seed(rows=50)
    first = state()
    first_ids = set(ActivityEvent.objects.values_list("pk", flat=True))

    second_output = seed(rows=50)

    # Every run prints a working token: a fresh one, the earlier one being shown only once.
    assert state() == {**first, "tokens": first["tokens"] + 1}
    assert set(ActivityEvent.objects.values_list("pk", flat=True)) == first_ids
    tokens = [re.search(r"API token for acme-owner \(shown once\): (fs_\S+)", out).group(1)
              for out in (first_output, second_output)]
    assert tokens[0] != tokens[1] and "1 earlier demo token(s) still valid" in second_output
    for raw in tokens:
        assert ApiToken.objects.get(key_hash=hash_token(raw)).is_usable


def test_seed_demo_with_more_rows_tops_up_without_replacing_existing_data():
    seed(rows=50)
    before = set(ActivityEvent.objects.values_list("pk", flat=True))

    seed(rows=80)

    assert state()["activity"] == {slug: 80 for slug in SLUGS}
    assert before <= set(ActivityEvent.objects.values_list("pk", flat=True))


def test_seed_demo_with_fewer_rows_deletes_nothing():
    seed(rows=50)

    seed(rows=10)

    assert state()["activity"] == {slug: 50 for slug in SLUGS}


def test_the_admin_can_log_in_with_the_printed_password():
    output = seed(rows=5)

    password = printed_admin_password(output)
    admin = get_user_model().objects.get(username="admin")
    assert admin.is_superuser and admin.is_staff
    client = Client()
    response = client.post("/admin/login/?next=/admin/", {"username": "admin", "password": password})
    assert response.status_code == 302 and response["Location"] == "/admin/"
    assert client.get("/admin/").status_code == 200


def test_the_admin_login_still_works_after_a_second_run():
    seed(rows=5)
    output = seed(rows=5)

    assert Client().login(username="admin", password=printed_admin_password(output))


def test_a_custom_admin_password_is_printed_and_works_for_every_demo_user():
    output = seed(rows=5, admin_password="correct-horse-42")

    assert printed_admin_password(output) == "correct-horse-42"
    assert "<slug>-owner, <slug>-operator / correct-horse-42" in output
    for username in ("admin", "acme-owner", "globex-operator"):
        assert Client().login(username=username, password="correct-horse-42"), username


def test_the_printed_api_token_belongs_to_the_acme_owner():
    output = seed(rows=5)

    raw = re.search(r"API token for acme-owner \(shown once\): (\S+)", output).group(1)
    token = ApiToken.objects.get(key_hash=hash_token(raw))
    assert token.user.username == "acme-owner"
    assert raw not in str(list(ApiToken.objects.values()))  # only its hash is stored


def test_demo_operators_can_use_the_admin_but_only_to_view():
    seed(rows=5)

    operator = get_user_model().objects.get(username="acme-operator")
    assert operator.is_staff and not operator.is_superuser
    assert operator.has_perm("exports.view_exportrecord")
    assert operator.has_perm("scheduling.view_taskrun")
    assert not operator.has_perm("exports.change_exportrecord")
    assert not operator.has_perm("budgets.change_budget")
