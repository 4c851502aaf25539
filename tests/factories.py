import datetime as dt
from decimal import Decimal

import factory
from django.contrib.auth import get_user_model

from budgets.models import Account, Membership, Role
from exports.models import ActivityEvent


class UserFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = get_user_model()
        django_get_or_create = ["username"]

    username = factory.Sequence(lambda n: f"user{n}")
    email = factory.LazyAttribute(lambda u: f"{u.username}@example.com")


class AccountFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Account
        django_get_or_create = ["slug"]

    slug = factory.Sequence(lambda n: f"account-{n}")
    name = factory.LazyAttribute(lambda a: a.slug.title())


class MembershipFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = Membership

    user = factory.SubFactory(UserFactory)
    account = factory.SubFactory(AccountFactory)
    role = Role.OWNER


class ActivityEventFactory(factory.django.DjangoModelFactory):
    class Meta:
        model = ActivityEvent

    account = factory.SubFactory(AccountFactory)
    occurred_at = factory.Sequence(lambda n: dt.datetime(2026, 3, 1, tzinfo=dt.UTC) + dt.timedelta(minutes=n))
    actor_email = factory.Sequence(lambda n: f"actor{n}@example.com")
    event_type = "invoice.paid"
    amount = Decimal("12.50")
    description = "ok"
