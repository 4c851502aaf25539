"""`manage.py demo_workload`: the demo's generated workload (exports/demo.py), until stopped."""
from django.core.management.base import BaseCommand

from exports import demo


class Command(BaseCommand):
    help = ("Generate the demo's workload: globex floods, initech is light, umbrella hits its CPU cap, acme runs a "
            "recurring export, and every minute a job fails once and is retried, one fails for good and an export "
            "is retried after a storage error (workers need FAIRSHARE_EXTRA_JOB_MODULES=exports.demo, and "
            "FAIRSHARE_EXPORTS_STORAGE_BACKEND=exports.demo.HiccupStorage for the storage error).")

    def add_arguments(self, parser):
        parser.add_argument("--duration", type=float, help="stop after this many seconds (default: run until stopped)")

    def handle(self, *, duration, **options):
        self.stdout.write("demo workload: globex floods, initech is light, umbrella hits its CPU cap, "
                          "acme runs a recurring export; failures on purpose every minute")
        demo.run(duration_s=duration, log=lambda line: self.stdout.write(f"demo workload: {line}"))
