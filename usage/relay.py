"""The relay: outbox rows to the retained log, then deleted (docs/usage-log.md "The relay").

One round: read the oldest committed rows by id, publish them (the sink returns once the log
stored them all), delete them. A relay that dies between publishing and deleting publishes them
again when it restarts, and the log drops them as duplicates (the event id is the message id); a
log that is down leaves the rows where they are, and the relay tries again. One relay at a time:
it holds a PostgreSQL advisory lock for as long as it runs (a second one waits for it).
"""
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.db import DatabaseError, connection

from scheduling import db
from scheduling.faults import fault_point
from usage.sinks import OutgoingEvent, Sink, SinkUnavailable

log = logging.getLogger(__name__)

# pg_advisory_lock's key for "the relay runs": any constant no other lock of this database uses.
RELAY_LOCK = 0x75736167  # "usag"
QUERIES = db.load_queries(Path(__file__).with_name("queries.sql"))


def oldest(batch: int | None = None) -> list[tuple[int, OutgoingEvent]]:
    """The oldest committed outbox rows, by id, each with its event as the log keeps it."""
    rows = db.fetch_all(QUERIES["oldest"], {"batch": batch or settings.FAIRSHARE["USAGE_RELAY_BATCH"]})
    return [(row["id"], OutgoingEvent(row["event_id"], row["subject"], row["body"].encode())) for row in rows]


def relay_once(sink: Sink, *, batch: int | None = None) -> int:
    """Publish the oldest committed outbox rows and delete them; returns how many. Raises
    SinkUnavailable (nothing deleted) when the log did not take them."""
    rows = oldest(batch)
    if not rows:
        return 0
    sink.publish([event for _, event in rows])
    fault_point("usage_after_publish")
    with connection.cursor() as cursor:
        cursor.execute(QUERIES["delete"], {"ids": [row_id for row_id, _ in rows]})
    return len(rows)


@dataclass
class Backoff:
    """Seconds to wait before trying the log again: doubling from `first` up to `most`."""

    first: float = 0.5
    most: float = 5.0
    wait: float = 0.0

    def failed(self) -> float:
        self.wait = min(self.most, self.wait * 2 if self.wait else self.first)
        return self.wait

    def succeeded(self) -> None:
        self.wait = 0.0


def run(sink: Sink, *, poll_s: float, stop=lambda: False) -> None:
    """Relay until `stop()` says so, once no other relay runs: while full batches wait, round after
    round; once caught up, a look every `poll_s`; while the log is down, again after a back-off (the outbox
    keeps everything)."""
    if not _take_the_relay_lock(poll_s=poll_s, stop=stop):
        return
    backoff = Backoff()
    try:
        while not stop():
            try:
                moved = relay_once(sink)
            except SinkUnavailable as exc:
                wait = backoff.failed()
                log.warning("usage relay: the log is unavailable (%s); the outbox keeps the events, next try in "
                            "%.1f s", exc, wait)
                time.sleep(wait)
                continue
            backoff.succeeded()
            if moved < settings.FAIRSHARE["USAGE_RELAY_BATCH"]:
                # Caught up: wait before the next look, so that what comes meanwhile goes in one round
                # (a round per event costs the relay and the database a round trip each; the lag this
                # adds is at most `poll_s`).
                time.sleep(poll_s)
    finally:
        # A database error ends the relay (its supervisor starts it again): the lock is its session's,
        # and a connection Django opened anew would relay without it.
        sink.close()
        with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [RELAY_LOCK])


def _take_the_relay_lock(*, poll_s: float, stop) -> bool:
    """Wait for the relay's lock (another relay holds it while it runs); False if told to stop first."""
    waiting = False
    while not stop():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_try_advisory_lock(%s)", [RELAY_LOCK])
            if cursor.fetchone()[0]:
                return True
        if not waiting:
            log.info("usage relay: another relay runs; waiting for it to stop")
            waiting = True
        time.sleep(max(poll_s, 1.0))
    return False
