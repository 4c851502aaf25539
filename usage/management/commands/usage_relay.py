"""manage.py usage_relay: publish the usage outbox to NATS JetStream (docs/usage-log.md)."""
import signal

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from usage import relay
from usage.sinks import NatsSink, SinkUnavailable


class Command(BaseCommand):
    help = ("Publish usage events from the outbox to the NATS JetStream stream FAIRSHARE_USAGE_STREAM and delete "
            "what the stream acknowledged; runs beside qcluster, one at a time (a second one waits). Needs "
            "FAIRSHARE_USAGE_NATS_URL. While NATS is down the outbox keeps the events and the relay tries again.")

    def add_arguments(self, parser):
        parser.add_argument("--poll", type=float, default=0.2,
                            help="seconds between rounds once caught up (default 0.2): what comes meanwhile goes in one "
                                 "round; the most this adds to an event's time to the stream")
        parser.add_argument("--once", action="store_true",
                            help="publish what the outbox holds now, then exit (1 if NATS is unavailable)")

    def handle(self, *args, poll: float, once: bool, **options):
        url = settings.FAIRSHARE["USAGE_NATS_URL"]
        if not url:
            raise CommandError("FAIRSHARE_USAGE_NATS_URL is not set: the usage log is off")
        sink = NatsSink(url)
        if once:
            moved = 0
            try:
                while batch := relay.relay_once(sink):
                    moved += batch
            except SinkUnavailable as exc:
                raise CommandError(f"NATS is unavailable: {exc}") from exc
            finally:
                sink.close()
            self.stdout.write(f"published {moved} events")
            return
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        try:
            relay.run(sink, poll_s=poll, stop=lambda: bool(stopping))
        except KeyboardInterrupt:
            pass
