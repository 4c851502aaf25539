import json
import time

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from budgets.models import Account, Membership, Role
from exports.api import export_json
from exports.forms import ExportRequestForm
from exports.models import ExportRecord
from exports.requests import ExportRequestError, export_request


class Command(BaseCommand):
    help = (
        "Request an export of an account's report. The requester must be a member allowed to "
        "export (default: the account's first owner). Prints the export id, or JSON with --json."
    )

    def add_arguments(self, parser):
        parser.add_argument("--account", required=True, help="account slug")
        parser.add_argument("--start", required=True, help="first day, YYYY-MM-DD (UTC)")
        parser.add_argument("--end", required=True, help="last day, YYYY-MM-DD (UTC, inclusive)")
        parser.add_argument("--format", default="csv", help="output format (csv)")
        parser.add_argument("--source", default="activity", help="what to export: activity or usage")
        parser.add_argument("--user", help="username of the requester (default: the account's first owner)")
        parser.add_argument("--idempotency-key", help="repeat requests with the same key return the same export")
        parser.add_argument("--wait", action="store_true", help="wait until the export finishes, showing progress")
        parser.add_argument("--timeout", type=float, default=600, help="seconds --wait waits (default 600)")
        parser.add_argument("--json", action="store_true", help="print the export as JSON")

    def handle(self, *, account, start, end, format, source, user, idempotency_key, wait, timeout, **options):
        as_json = options["json"]
        form = ExportRequestForm({"start": start, "end": end, "format": format, "source": source,
                                  "idempotency_key": idempotency_key or ""})
        if not form.is_valid():
            raise CommandError(form.error_text())
        data = form.cleaned_data
        requester = self._requester(account, user)
        try:
            record, created = export_request(
                account_slug=account, user=requester, start=data["start"], end=data["end"], fmt=data["format"],
                source=data["source"], idempotency_key=data["idempotency_key"] or None,
            )
        except ExportRequestError as exc:
            raise CommandError(f"{exc.message} ({exc.code})") from None
        if not as_json:
            self.stdout.write(f"{'Requested' if created else 'Already requested'} export {record.pk}")
        if wait:
            record = self._wait(record, timeout=timeout, show_progress=not as_json)
        if as_json:
            self.stdout.write(json.dumps(export_json(record), indent=2))
        elif wait:
            self.stdout.write(f"{record.status}: {record.row_count or 0} rows, {record.byte_size or 0} bytes"
                              + (f" ({record.error_class}: {record.error_message})" if record.error_class else ""))
        if wait and record.status != "succeeded":
            raise CommandError(f"export {record.pk} ended {record.status}")

    def _requester(self, account: str, username: str | None):
        User = get_user_model()
        if username:
            requester = User.objects.filter(username=username).first()
            if requester is None:
                raise CommandError(f"No user {username!r}.")
            return requester
        owner = (Membership.objects.filter(account__slug=account, role=Role.OWNER)
                 .select_related("user").order_by("created_at").first())
        if owner is None:
            if not Account.objects.filter(slug=account).exists():
                raise CommandError(f"No account {account!r}. (unknown_account)")
            raise CommandError(f"Account {account!r} has no owner to act as; pass --user.")
        return owner.user

    def _wait(self, record: ExportRecord, *, timeout: float, show_progress: bool) -> ExportRecord:
        deadline = time.monotonic() + timeout
        bar = tqdm(total=record.rows_estimated or None, unit="rows", disable=not show_progress, file=self.stderr._out)
        while not record.is_finished:
            if time.monotonic() > deadline:
                bar.close()
                raise CommandError(f"export {record.pk} is still {record.status} after {timeout:g}s")
            time.sleep(0.5)
            record.refresh_from_db()
            bar.n = record.rows_written
            bar.set_postfix_str(record.status)
            bar.refresh()
        bar.close()
        return record
