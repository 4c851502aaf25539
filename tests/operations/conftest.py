import pytest

from budgets.models import Role
from tests.factories import MembershipFactory, UserFactory


@pytest.fixture
def operator(account):
    return MembershipFactory(account=account, user=UserFactory(username="acme-operator", is_staff=True),
                             role=Role.OPERATOR).user


@pytest.fixture
def root(db):
    return UserFactory(username="root", is_staff=True, is_superuser=True)


# Real export workers for the browser test (FAST_RECOVERY settings, e-mail to files).
from tests.exports.conftest import mail_dir, start_exports  # noqa: E402,F401
