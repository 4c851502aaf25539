from django.core.management.base import BaseCommand

from scheduling.schedules import sync_schedules


class Command(BaseCommand):
    help = "Create, update and remove django-q2 schedules to match those declared in scheduling/schedules.py."

    def handle(self, **options):
        counts = sync_schedules()
        self.stdout.write(", ".join(f"{n} {k}" for k, n in counts.items()))
