from django.apps import AppConfig
from django.utils.module_loading import autodiscover_modules


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling and task runs"

    def ready(self) -> None:
        # Every app declares its jobs in `<app>/jobs.py`; importing them fills the registry.
        autodiscover_modules("jobs")
