from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from budgets.models import Account
from scheduling.pausing import pause, resume


class Command(BaseCommand):
    help = ("Pause an account's work (every queue, or --queue) or a whole queue (--queue alone, superusers): "
            "its new work waits in the holding area with reason \"paused\". --resume lifts the pause and "
            "releases that work. Acts as --user and is written to the admin log.")

    def add_arguments(self, parser):
        parser.add_argument("--account", metavar="SLUG", help="the account to pause")
        parser.add_argument("--queue", default="", help="only this queue (with --account), or this whole queue")
        parser.add_argument("--resume", action="store_true", dest="lift", help="lift the pause and release its held work")
        parser.add_argument("--user", required=True, help="the username the action is done as")

    def handle(self, *, account, queue, lift: bool, user, **options):
        actor = get_user_model().objects.filter(username=user).first()
        if actor is None:
            raise CommandError(f"No user {user!r}.")
        if not account and not queue:
            raise CommandError("Name an --account, a --queue, or both.")
        target = None
        if account:
            target = Account.objects.filter(slug=account).first()
            if target is None:
                raise CommandError(f"No account {account!r}.")
        result = (resume if lift else pause)(user=actor, account=target, queue=queue)
        if not result.ok:
            raise CommandError(str(result))
        self.stdout.write(str(result))
