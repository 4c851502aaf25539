"""The budgets app's FAIRSHARE settings (see scheduling/conf.py for how apps declare them).

Importable before Django is set up (config/settings.py imports it): no django.conf here.
"""
from scheduling.conf import Setting

# Default budgets per plan tier and queue: the daily CPU seconds and concurrent tasks, the weight of
# the account's share of busy workers, and a rate limit (at most `rate_starts` runs started in any
# `rate_period_s` seconds; None: none). An operator can override them per account (budgets.Budget).
# Every tier needs an entry for every queue (system checks budgets.E003, E004).
PLAN_BUDGETS = {
    "free": {"default": {"cpu_seconds_per_day": 600, "max_concurrent": 1, "weight": 1,
                         "rate_starts": 600, "rate_period_s": 60},
             "exports": {"cpu_seconds_per_day": 300, "max_concurrent": 1, "weight": 1,
                         "rate_starts": 30, "rate_period_s": 3600}},
    "standard": {"default": {"cpu_seconds_per_day": 3600, "max_concurrent": 2, "weight": 2,
                             "rate_starts": None, "rate_period_s": 60},
                 "exports": {"cpu_seconds_per_day": 1800, "max_concurrent": 1, "weight": 2,
                             "rate_starts": None, "rate_period_s": 60}},
    "enterprise": {"default": {"cpu_seconds_per_day": 36000, "max_concurrent": 8, "weight": 4,
                               "rate_starts": None, "rate_period_s": 60},
                   "exports": {"cpu_seconds_per_day": 18000, "max_concurrent": 4, "weight": 4,
                               "rate_starts": None, "rate_period_s": 60}},
}

SETTINGS = (
    Setting("BUDGET_DAY_TIMEZONE", "FAIRSHARE_BUDGET_DAY_TIMEZONE", "UTC",
            doc="the zone whose midnight starts a budget day"),
    Setting("RESERVATION_LEASE_S", "FAIRSHARE_RESERVATION_LEASE", 60, parse=int, unit="s",
            doc="a running task's reservation and slot are reclaimed when its watcher has not renewed "
                "the lease for this long (its worker died)"),
    Setting("RESERVATION_HEARTBEAT_S", "FAIRSHARE_RESERVATION_HEARTBEAT", 5.0, parse=float, unit="s",
            doc="how often a running task's watcher renews its reservation's lease and reports the CPU "
                "used so far; below the lease"),
    Setting("RESERVATION_STEP_MS", "FAIRSHARE_RESERVATION_STEP", 1000, parse=int, unit="ms",
            doc="a run reserves CPU in steps of at least this much (its job's estimate if larger) and "
                "reserves the next step when less than half of one is left: the runs of an account never "
                "hold more than it has left today, so together they stop at the daily cap"),
    Setting("CHARGE_CARRY_S", "FAIRSHARE_CHARGE_CARRY", 1.0, parse=float, unit="s",
            doc="a slot passed from run to run of one account (PostgreSQL) carries its runs' charges and "
                "charges them to the day's usage row when the chain ends or after this long, instead of "
                "with every run: their CPU stays reserved meanwhile, so the cap holds exactly; what the "
                "usage row shows as used lags by at most this much; 0: every settlement charges"),
    Setting("BUDGET_TICK_S", "FAIRSHARE_BUDGET_TICK", 0.2, parse=float, unit="s",
            doc="how often a running task's watcher looks at its CPU: about the most a job that never "
                "checks its budget overshoots by"),
    Setting("DISPATCH_LEASE_S", "FAIRSHARE_DISPATCH_LEASE", 300, parse=int, unit="s",
            doc="a job sent to the broker holds one of its account's slots until it starts; a message "
                "lost for this long gives the slot back"),
    Setting("METRICS_ACCOUNTS", "FAIRSHARE_METRICS_ACCOUNTS", 100, parse=int,
            doc="`/metrics` reports the budget gauges of this many accounts, those that used the most CPU today; "
                "0: of every account"),
    Setting("PLAN_BUDGETS", None, PLAN_BUDGETS, shown_default="see `budgets/conf.py`",
            doc="default daily CPU seconds, concurrent tasks, weight and rate limit per plan tier and queue"),
)
