import uuid

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from exports.operations import export_retry


class Command(BaseCommand):
    help = ("Run a failed or cancelled export again: same id, a fresh attempt budget, its history kept. "
            "Acts as --user (an operator or owner of the export's account, or a superuser) and is written "
            "to the admin log.")

    def add_arguments(self, parser):
        parser.add_argument("export_ids", nargs="+", metavar="EXPORT_ID", help="the export's id (UUID)")
        parser.add_argument("--user", required=True, help="the username the retry is done as")

    def handle(self, *, export_ids, user, **options):
        actor = get_user_model().objects.filter(username=user).first()
        if actor is None:
            raise CommandError(f"No user {user!r}.")
        try:
            ids = [uuid.UUID(value) for value in export_ids]
        except ValueError:
            raise CommandError("Export ids are UUIDs.") from None
        results = export_retry(user=actor, export_ids=ids)
        for result in results:
            (self.stdout if result.ok else self.stderr).write(str(result))
        if not all(result.ok for result in results):
            raise CommandError("Some exports were not retried (see above).")
