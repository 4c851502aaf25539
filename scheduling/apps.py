from importlib import import_module

from django.apps import AppConfig
from django.conf import settings
from django.core import checks
from django.db.models.signals import post_migrate
from django.utils.module_loading import autodiscover_modules


def _sync_schedules(sender, using, **kwargs) -> None:
    from scheduling.schedules import sync_schedules

    sync_schedules()


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling and task runs"

    def ready(self) -> None:
        # Every app declares its jobs in `<app>/jobs.py`; importing them fills the registry.
        autodiscover_modules("jobs")
        # ...and its /metrics families and /healthz checks in `<app>/ops.py` (the kernel's first).
        import_module("scheduling.ops")
        autodiscover_modules("ops")
        for module in settings.FAIRSHARE["EXTRA_JOB_MODULES"]:
            import_module(module)
        # Deploys run `migrate`: the declared schedules follow the code that declares them.
        post_migrate.connect(_sync_schedules, sender=self, dispatch_uid="fairshare.sync_schedules")

        from django_q.signals import post_execute_in_worker, post_spawn

        from scheduling.pulse import start_pulse
        from scheduling.runtime import redact_failed_result

        post_spawn.connect(start_pulse, dispatch_uid="fairshare.pulse")
        # Every pool's workers take their tasks over channels of their own: a killed worker never
        # stalls the others (scheduling.pool).
        from scheduling import pool

        pool.install()
        post_execute_in_worker.connect(redact_failed_result, dispatch_uid="fairshare.redact_result")

        # Invariants between settings; `qcluster` runs them too (an Error stops it).
        from scheduling import checks as kernel_checks

        for check in (kernel_checks.check_clusters, kernel_checks.check_pulse, kernel_checks.check_stall_threshold,
                      kernel_checks.check_metrics_networks, kernel_checks.check_logging_redacts,
                      kernel_checks.check_envelope_version, kernel_checks.check_database_timeouts):
            checks.register(check, "fairshare")
