import json
import uuid

from django.core.management.base import BaseCommand, CommandError

from exports.api import export_json
from exports.models import ExportRecord


class Command(BaseCommand):
    help = "Show an export's status, result and attempts."

    def add_arguments(self, parser):
        parser.add_argument("export_id", help="the export's id (UUID)")
        parser.add_argument("--json", action="store_true", help="print JSON")

    def handle(self, *, export_id, **options):
        try:
            pk = uuid.UUID(export_id)
        except ValueError:
            raise CommandError(f"{export_id!r} is not an export id (a UUID).") from None
        record = ExportRecord.objects.select_related("account").filter(pk=pk).first()
        if record is None:
            raise CommandError(f"No export {export_id}.")
        attempts = list(record.attempts.values("number", "outcome", "rows_written", "error_class", "error_message",
                                               "started_at", "finished_at"))
        if options["json"]:
            data = export_json(record)
            data["attempt_log"] = [
                {**a, "started_at": a["started_at"].isoformat(),
                 "finished_at": a["finished_at"].isoformat() if a["finished_at"] else None}
                for a in attempts
            ]
            self.stdout.write(json.dumps(data, indent=2))
            return
        data = export_json(record)
        self.stdout.write(f"export   {record.pk}")
        self.stdout.write(f"account  {record.account.slug}   source {record.source}   "
                          f"range {record.start_date}..{record.end_date}   format {record.format}")
        progress = data["progress_percent"]
        self.stdout.write(f"status   {record.status}" + (f" ({progress}%)" if progress is not None else ""))
        if record.row_count is not None:
            self.stdout.write(f"result   {record.row_count} rows, {record.byte_size} bytes, sha256 {record.checksum_sha256}")
        if record.error_class:
            self.stdout.write(f"error    {record.error_class}: {record.error_message}")
        for a in attempts:
            line = f"attempt  #{a['number']} {a['outcome']} rows={a['rows_written']} started={a['started_at']:%Y-%m-%d %H:%M:%S}"
            if a["error_class"]:
                line += f" {a['error_class']}: {a['error_message']}"
            self.stdout.write(line)
