"""System checks for the budgets app's settings (registered in BudgetsConfig.ready)."""
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from django.conf import settings
from django.core import checks

from budgets.models import Plan, Queue
from scheduling.conf import clusters

LIMITS = ("cpu_seconds_per_day", "max_concurrent", "weight", "rate_starts", "rate_period_s")
# The least each may be (rate_starts may also be None: no rate limit).
LEAST = {"cpu_seconds_per_day": 0, "max_concurrent": 0, "weight": 1, "rate_starts": 1, "rate_period_s": 1}


def _well_formed(limits: dict) -> bool:
    return sorted(limits) == sorted(LIMITS) and all(
        (key == "rate_starts" and limits[key] is None)
        or (isinstance(limits[key], int) and not isinstance(limits[key], bool) and limits[key] >= LEAST[key])
        for key in LIMITS)


def check_leases(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    options, errors = settings.FAIRSHARE, []
    lease, renew_every = options["RESERVATION_LEASE_S"], options["RESERVATION_HEARTBEAT_S"] + options["BUDGET_TICK_S"]
    if lease <= renew_every:
        errors.append(checks.Error(
            f'FAIRSHARE["RESERVATION_LEASE_S"] ({lease} s) must be larger than RESERVATION_HEARTBEAT_S + '
            f"BUDGET_TICK_S ({renew_every:g} s).",
            hint="A running task's watcher renews its reservation's lease about that often, so a live run "
                 "would be reclaimed as dead between two renewals. Raise FAIRSHARE_RESERVATION_LEASE or "
                 "lower FAIRSHARE_RESERVATION_HEARTBEAT.",
            id="budgets.E001"))
    dispatch = options["DISPATCH_LEASE_S"]
    slowest_poll = max(c.get("poll", 0) for c in clusters(settings.Q_CLUSTER).values())
    if dispatch <= slowest_poll:
        errors.append(checks.Error(
            f'FAIRSHARE["DISPATCH_LEASE_S"] ({dispatch} s) must be larger than the slowest queue\'s poll '
            f"({slowest_poll:g} s).",
            hint="A job sent to the broker waits up to a poll before even an idle worker takes it; its slot "
                 "would be given back before it starts, and the account could run more than its "
                 "max_concurrent. Raise FAIRSHARE_DISPATCH_LEASE.",
            id="budgets.E002"))
    return errors


def check_plan_budgets(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Every plan tier has a default budget on every queue (admission creates it on first use)."""
    plans, errors = settings.FAIRSHARE["PLAN_BUDGETS"], []
    for plan in Plan.values:
        for queue in Queue.values:
            limits = plans.get(plan, {}).get(queue)
            if limits is None:
                errors.append(checks.Error(
                    f'FAIRSHARE["PLAN_BUDGETS"] has no budget for plan "{plan}" on queue "{queue}".',
                    hint="Admitting that plan's first job on that queue would fail. Give every plan tier an "
                         '{"cpu_seconds_per_day": ..., "max_concurrent": ...} entry for every queue.',
                    id="budgets.E003"))
            elif not _well_formed(limits):
                errors.append(checks.Error(
                    f'FAIRSHARE["PLAN_BUDGETS"]["{plan}"]["{queue}"] is {limits!r}.',
                    hint="It needs exactly cpu_seconds_per_day and max_concurrent (whole numbers of at least 0), "
                         "weight (at least 1), rate_starts (at least 1, or None: no rate limit) and "
                         "rate_period_s (seconds, at least 1).",
                    id="budgets.E004"))
    return errors


def check_budget_day_timezone(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    zone = settings.FAIRSHARE["BUDGET_DAY_TIMEZONE"]
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError):
        return [checks.Error(
            f'FAIRSHARE["BUDGET_DAY_TIMEZONE"] {zone!r} is not a time zone.',
            hint='Set FAIRSHARE_BUDGET_DAY_TIMEZONE to an IANA zone name such as "UTC" or "Europe/Paris"; '
                 "every admission reads it.",
            id="budgets.E005")]
    return []
