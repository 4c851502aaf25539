"""The budgets app's settings invariants are system checks with named ids."""
from tests.conftest import fairshare_checks


def _fairshare(settings, **options):
    settings.FAIRSHARE = {**settings.FAIRSHARE, **options}


def test_a_reservation_lease_must_outlast_the_watchers_renewals(settings):
    _fairshare(settings, RESERVATION_LEASE_S=5, RESERVATION_HEARTBEAT_S=5.0, BUDGET_TICK_S=0.2)
    assert fairshare_checks() == [(
        "budgets.E001",
        'FAIRSHARE["RESERVATION_LEASE_S"] (5 s) must be larger than RESERVATION_HEARTBEAT_S + BUDGET_TICK_S (5.2 s).')]


def test_a_dispatch_lease_must_outlast_a_broker_poll(settings):
    settings.Q_CLUSTER = {**settings.Q_CLUSTER, "poll": 2}
    _fairshare(settings, DISPATCH_LEASE_S=2)
    assert fairshare_checks() == [(
        "budgets.E002", 'FAIRSHARE["DISPATCH_LEASE_S"] (2 s) must be larger than the slowest queue\'s poll (2 s).')]


def test_every_plan_needs_a_budget_on_every_queue(settings):
    plans = settings.FAIRSHARE["PLAN_BUDGETS"]
    _fairshare(settings, PLAN_BUDGETS={**plans, "free": {"default": plans["free"]["default"]}})
    assert fairshare_checks() == [
        ("budgets.E003", 'FAIRSHARE["PLAN_BUDGETS"] has no budget for plan "free" on queue "exports".')]


def test_a_plan_budget_needs_both_limits_as_whole_numbers(settings):
    plans = settings.FAIRSHARE["PLAN_BUDGETS"]
    broken = {"cpu_seconds_per_day": -1, "max_concurrent": 1}
    _fairshare(settings, PLAN_BUDGETS={**plans, "standard": {**plans["standard"], "default": broken}})
    assert fairshare_checks() == [(
        "budgets.E004",
        "FAIRSHARE[\"PLAN_BUDGETS\"][\"standard\"][\"default\"] is {'cpu_seconds_per_day': -1, 'max_concurrent': 1}.")]


def test_the_budget_day_needs_a_real_time_zone(settings):
    _fairshare(settings, BUDGET_DAY_TIMEZONE="Mars/Olympus")
    assert fairshare_checks() == [
        ("budgets.E005", "FAIRSHARE[\"BUDGET_DAY_TIMEZONE\"] 'Mars/Olympus' is not a time zone.")]
