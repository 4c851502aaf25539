from django.apps import AppConfig
from django.core import checks


class ExportsConfig(AppConfig):
    name = "exports"
    verbose_name = "Exports"

    def ready(self) -> None:
        from exports import checks as export_checks

        for check in (export_checks.check_attempt_deadline, export_checks.check_stream_strategy):
            checks.register(check, "fairshare")
