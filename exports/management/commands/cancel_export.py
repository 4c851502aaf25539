import uuid

from django.core.management.base import BaseCommand, CommandError

from exports.leases import export_cancel
from exports.models import ExportRecord


class Command(BaseCommand):
    help = ("Cancel an export: at once if it is waiting, between batches if it is running. "
            "Nothing is published for a cancelled export.")

    def add_arguments(self, parser):
        parser.add_argument("export_id", help="the export's id (UUID)")

    def handle(self, *, export_id, **options):
        try:
            status = export_cancel(export_id=uuid.UUID(export_id))
        except ValueError:
            raise CommandError(f"{export_id!r} is not an export id (a UUID).") from None
        except ExportRecord.DoesNotExist:
            raise CommandError(f"No export {export_id}.") from None
        if status == "running":
            self.stdout.write(f"Cancellation requested; export {export_id} stops at its next batch.")
        else:
            self.stdout.write(f"Export {export_id} is {status}.")
