"""The usage log's FAIRSHARE settings (see scheduling/conf.py for how apps declare them).

Importable before Django is set up (config/settings.py imports it): no django.conf here.
"""
from scheduling.conf import Setting

NATS_URL = Setting(
    "USAGE_NATS_URL", "FAIRSHARE_USAGE_NATS_URL", "", shown_default="unset",
    doc="the NATS server (JetStream on) the usage log is kept in, e.g. `nats://127.0.0.1:4222`; unset: no usage "
        "events are written and `usage_relay` does not start. Set it on every process (web, workers, relay): "
        "only a connection of a process that has it writes events (docs/usage-log.md)")

SETTINGS = (
    NATS_URL,
    Setting("USAGE_STREAM", "FAIRSHARE_USAGE_STREAM", "FAIRSHARE_USAGE",
            doc="the JetStream stream that keeps the usage events"),
    Setting("USAGE_SUBJECT_PREFIX", "FAIRSHARE_USAGE_SUBJECT_PREFIX", "fairshare.usage",
            doc="events are published on `<prefix>.run.<queue>.<account>` and `<prefix>.export.<account>`"),
    Setting("USAGE_MAX_AGE_DAYS", "FAIRSHARE_USAGE_MAX_AGE_DAYS", 400, parse=int, unit="days",
            doc="the stream keeps an event this long (a year and a month of bills); 0: no age limit"),
    Setting("USAGE_MAX_BYTES", "FAIRSHARE_USAGE_MAX_BYTES", 16 * 1024 ** 3, parse=int, unit="bytes",
            shown_default="16 GiB",
            doc="the stream drops its oldest events beyond this size (an event is about 600 bytes); the server "
                "reserves it in its JetStream store when the stream is made; -1: no limit"),
    Setting("USAGE_DUPLICATE_WINDOW_S", "FAIRSHARE_USAGE_DUPLICATE_WINDOW_S", 600, parse=int, unit="s",
            doc="the stream drops an event whose id it stored this recently (a relay that died between publishing "
                "and deleting publishes it again)"),
    Setting("USAGE_RELAY_BATCH", "FAIRSHARE_USAGE_RELAY_BATCH", 500, parse=int, unit="events",
            doc="events the relay publishes per round trip to the database"),
    Setting("USAGE_RELAY_BEHIND_S", "FAIRSHARE_USAGE_RELAY_BEHIND_S", 60, parse=int, unit="s",
            doc="/healthz reports the relay behind when the oldest unpublished event is older than this"),
)

# The session setting on which events are written (the settlement, the triggers): "1" on the connections of a process with USAGE_NATS_URL
# (config/settings.py adds it to the connection's options).
EVENTS_GUC = "fairshare_usage.events"
