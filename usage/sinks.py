"""Where the relay sends usage events: a retained log behind a small interface, so that another
log (Kafka: a producer with idempotence on, the event id as the record's key) is one class more.

A sink's `publish` returns once the log has stored every event of the batch, or raises
`SinkUnavailable`; it stores each event id at most once within its duplicate window, so a relay
that publishes a batch again (it died before deleting it) adds nothing.
"""
import asyncio
from dataclasses import dataclass

from django.conf import settings


class SinkUnavailable(Exception):
    """The log did not acknowledge the batch (down, unreachable, too slow): nothing may be deleted."""


@dataclass(frozen=True)
class OutgoingEvent:
    event_id: str
    subject: str  # relative to the sink's prefix: run.<queue>.<account>, export.<account>
    payload: bytes  # the event's JSON (docs/usage-log.md)


class Sink:
    """The base of every sink; `open` and `close` are optional."""

    def open(self) -> None:
        pass

    def publish(self, events: list[OutgoingEvent]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


def stream_config() -> dict:
    """The stream's settings (FAIRSHARE["USAGE_*"]): its subjects and retention limits."""
    conf = settings.FAIRSHARE
    return {
        "name": conf["USAGE_STREAM"], "subjects": [f"{conf['USAGE_SUBJECT_PREFIX']}.>"],
        "max_age": conf["USAGE_MAX_AGE_DAYS"] * 86400.0, "max_bytes": conf["USAGE_MAX_BYTES"],
        "duplicate_window": float(conf["USAGE_DUPLICATE_WINDOW_S"]),
    }


async def ensure_stream(js) -> None:
    """Create the stream, or bring an existing one's limits to the settings."""
    from nats.js.api import StreamConfig
    from nats.js.errors import NotFoundError

    config = StreamConfig(**stream_config())
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        await js.add_stream(config)
    else:
        await js.update_stream(config)


async def connect(url: str):
    """A NATS connection that does not reconnect by itself: the relay decides when to try again."""
    import nats

    return await nats.connect(url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)


class NatsSink(Sink):
    """JetStream: each event published with its id as `Nats-Msg-Id` (the stream's de-duplication),
    a batch's publishes in flight together, in outbox order, each awaited for its acknowledgement
    (publish_async: one reply subscription for them all, about 30 µs of client CPU an event)."""

    ACK_TIMEOUT_S = 5.0

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = settings.FAIRSHARE["USAGE_SUBJECT_PREFIX"]
        self.loop = asyncio.new_event_loop()
        self.nc = None
        self.js = None

    def open(self) -> None:
        try:
            self.loop.run_until_complete(self._open())
        except Exception as exc:
            self.close()
            raise SinkUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _open(self) -> None:
        self.nc = await connect(self.url)
        self.js = self.nc.jetstream(timeout=self.ACK_TIMEOUT_S)
        await ensure_stream(self.js)

    def publish(self, events: list[OutgoingEvent]) -> None:
        if self.nc is None or not self.nc.is_connected:
            self.close()
            self.open()
        try:
            self.loop.run_until_complete(self._publish(events))
        except Exception as exc:
            self.close()
            raise SinkUnavailable(f"{type(exc).__name__}: {exc}") from exc

    async def _publish(self, events: list[OutgoingEvent]) -> None:
        # Sent in order, one after the other without waiting; then every acknowledgement awaited.
        acks = [await self.js.publish_async(f"{self.prefix}.{e.subject}", e.payload,
                                            headers={"Nats-Msg-Id": e.event_id}) for e in events]
        await asyncio.wait_for(asyncio.gather(*acks), self.ACK_TIMEOUT_S)

    def close(self) -> None:
        if self.nc is not None:
            nc, self.nc, self.js = self.nc, None, None
            try:
                self.loop.run_until_complete(nc.close())
            except Exception:
                pass
