from django.apps import AppConfig
from django.core import checks


class BudgetsConfig(AppConfig):
    name = "budgets"
    verbose_name = "Accounts and budgets"

    def ready(self) -> None:
        from budgets import checks as budget_checks

        for check in (budget_checks.check_leases, budget_checks.check_plan_budgets,
                      budget_checks.check_budget_day_timezone):
            checks.register(check, "fairshare")
