"""The kernel's FAIRSHARE settings, and the one way every app declares its own.

Each app lists its keys of ``settings.FAIRSHARE`` in ``<app>/conf.py`` as `Setting`s: the key,
the environment variable that sets it, how that variable is parsed, the default, the unit and one
line of doc. config/settings.py builds FAIRSHARE from these lists (the environment is read once, at
start-up); code reads ``settings.FAIRSHARE["KEY"]``; README.md's configuration table is generated
from the same lists (``python -m config.readme``; a test fails when the two disagree). Invariants
between settings are system checks (``<app>/checks.py``).

A new variable is named like its key, unit included (key ``STALL_AFTER_S``, variable
``FAIRSHARE_STALL_AFTER_S``); older ones keep the names deployments already use.

Importable before Django is set up (config/settings.py imports it): no django.conf here.
"""
import copy
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from scheduling.envelope import VERSION as ENVELOPE_VERSION

_UNSET = object()
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})


def flag(raw: str) -> bool:
    return raw.strip().lower() in TRUE_WORDS


def names(raw: str) -> list[str]:
    """A comma-separated list; empty items are dropped."""
    return [item for item in raw.split(",") if item]


_KINDS = {int: "a whole number", float: "a number"}


@dataclass(frozen=True)
class Setting:
    key: str | None  # the FAIRSHARE key; None for a variable config/settings.py uses by itself
    env: str | None  # the environment variable; None when only a settings module sets the key
    default: Any
    doc: str
    parse: Callable[[str], Any] = str
    unit: str = ""  # "s", "ms", "rows", "days"
    shown_default: str | None = None  # how the README shows a default computed at start-up
    sets: str | None = None  # what a variable without a key sets, e.g. 'Q_CLUSTER["timeout"]'

    def read(self, environ: Mapping[str, str] = os.environ, *, default: Any = _UNSET) -> Any:
        """The value the environment gives, else the default (a fresh copy: defaults are shared)."""
        raw = None if self.env is None else environ.get(self.env)
        if raw is None:
            return copy.deepcopy(self.default if default is _UNSET else default)
        try:
            return self.parse(raw)
        except ValueError:
            unit = f" ({self.unit})" if self.unit else ""
            raise ImproperlyConfigured(
                f"{self.env} must be {_KINDS.get(self.parse, 'valid')}{unit}, got {raw!r}.") from None


def read_settings(*declarations: Iterable[Setting], environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """FAIRSHARE entries from the apps' declarations; a key declared twice is a mistake."""
    values: dict[str, Any] = {}
    for setting in (s for group in declarations for s in group):
        if setting.key in values:
            raise ImproperlyConfigured(f'FAIRSHARE["{setting.key}"] is declared twice.')
        values[setting.key] = setting.read(environ)
    return values


def clusters(q_cluster: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each django-q2 cluster's effective options by name: Q_CLUSTER itself, then each of its
    ALT_CLUSTERS over it (the way django_q.conf merges them)."""
    base = {k: v for k, v in q_cluster.items() if k != "ALT_CLUSTERS"}
    found = {base.get("name", "default"): base}
    for name, options in (q_cluster.get("ALT_CLUSTERS") or {}).items():
        found[name] = {**base, **options, "name": name}
    return found


SETTINGS = (
    Setting("RELEASE_POLL_S", "FAIRSHARE_RELEASE_POLL", 1.0, parse=float, unit="s",
            doc="how often each worker's pulse releases due held work (a 2-second back-off need not wait "
                "for django-q2's 30-second scheduler) and may write its heartbeat; 0 turns the pulse off"),
    Setting("PREPARED_STATEMENTS", "FAIRSHARE_PREPARED_STATEMENTS", True, parse=flag,
            doc="prepare the admission, settlement, hand-off and enqueue statements once per database connection "
                "(PostgreSQL); turn off behind a pooler that cannot keep prepared statements (PgBouncer before 1.21 "
                "in transaction mode)"),
    Setting("HANDOFF_WINDOW_S", "FAIRSHARE_HANDOFF_WINDOW_S", 10.0, parse=float, unit="s",
            doc="after a run, a worker goes on with held work it claims itself (the same account's next "
                "job, else another account's in fair order) without a broker round trip, starting no new "
                "one after this long, nor after a tenth of its queue's `timeout`"),
    Setting("HANDOFF_MAX_RUNS", "FAIRSHARE_HANDOFF_MAX_RUNS", 500, parse=int,
            doc="at most this many claimed runs follow one broker message in a worker; 0 turns hand-off and "
                "pull off (every freed slot then goes through the broker)"),
    Setting("HANDOFF_CLAIM_LEASE_S", "FAIRSHARE_HANDOFF_CLAIM_LEASE_S", 30, parse=int, unit="s",
            doc="a held job claimed by a worker, and the slot taken for it, are given back when its run has "
                "not started within this long (the worker died)"),
    Setting("WORKER_HEARTBEAT_S", "FAIRSHARE_WORKER_HEARTBEAT", 10, parse=int, unit="s",
            doc="how often each worker's pulse writes the worker's heartbeat"),
    Setting("HEALTH_HEARTBEAT_MAX_AGE_S", "FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE", 60, parse=int, unit="s",
            doc="`/healthz` wants a worker per queue whose heartbeat is this recent"),
    Setting("QUEUE_STALL_AFTER_S", "FAIRSHARE_QUEUE_STALL_AFTER_S", 120.0, parse=float, unit="s",
            doc="`/healthz` (503) and `fairshare_queue_stalled` call a queue stalled when work has waited "
                "this long inside one of its pools that no idle worker of it takes, or when a message no "
                "cluster has fetched waited this long, no task of the queue started since it was sent and "
                "none is running: its workers beat but do no work"),
    Setting("STALLED_POOL_EXIT_AFTER_S", "FAIRSHARE_STALLED_POOL_EXIT_AFTER_S", 180.0, parse=float, unit="s",
            doc="a pool in which work has waited this long that no idle worker of it takes (what nobody foresaw: "
                "a killed worker no longer does that, scheduling.pool) ends itself, every process SIGKILLed and the main PID first (a non-zero "
                "exit), so that its supervisor starts it again; above `FAIRSHARE_QUEUE_STALL_AFTER_S`, so "
                "`/healthz` has said so meanwhile; 0: never"),
    Setting("METRICS_TOKEN", "FAIRSHARE_METRICS_TOKEN", "", shown_default="unset",
            doc="a bearer token that may read `/metrics`"),
    Setting("METRICS_ALLOWED_NETWORKS", "FAIRSHARE_METRICS_ALLOWED_NETWORKS", "127.0.0.1/32,::1/128",
            doc="client networks (comma-separated CIDRs) that may read `/metrics` without the token"),
    Setting("EXTRA_JOB_MODULES", "FAIRSHARE_EXTRA_JOB_MODULES", [], parse=names,
            doc="more job modules to import at start-up besides each app's `jobs.py` (comma-separated); "
                "the tests load `tests.jobs`"),
    Setting("TASK_RUN_RETENTION_DAYS", "FAIRSHARE_TASK_RUN_RETENTION_DAYS", 14, parse=int, unit="days",
            doc="maintenance rolls task runs older than this up per day and prunes them"),
    Setting("ENVELOPE_VERSION", "FAIRSHARE_ENVELOPE_VERSION", ENVELOPE_VERSION, parse=int,
            doc="the envelope version producers send (web, schedules, released work); pin the old one while "
                "a rolling upgrade has workers that do not speak the new one yet (docs/deploy.md)"),
    Setting("RABBITMQ_PREFIX", "FAIRSHARE_RABBITMQ_PREFIX", "fairshare",
            doc="with `RABBITMQ_URL`: each queue's RabbitMQ queue is named this, a dot and the queue's name "
                "(`fairshare.exports`), its dead letters the same and `.dead`"),
    Setting("RABBITMQ_QUEUE_TYPE", "FAIRSHARE_RABBITMQ_QUEUE_TYPE", "auto",
            doc="with `RABBITMQ_URL`: `quorum`, `classic` (durable either way) or `auto`: quorum queues on "
                "RabbitMQ 3.8 and later"),
    Setting("RABBITMQ_REDELIVER_AFTER_DEATH_S", "FAIRSHARE_RABBITMQ_REDELIVER_AFTER_DEATH_S", 130.0, parse=float,
            unit="s", doc="with `RABBITMQ_URL`: the message of a worker that died running it goes again this long "
                          "after its death, once the leases its run held have expired (the export lease, 120 s; the "
                          "reservation's, 60 s) so the redelivery takes the work over; the pool gets another "
                          "message meanwhile"),
    Setting("DJANGO_Q_RETENTION_DAYS", "FAIRSHARE_DJANGO_Q_RETENTION_DAYS", 7, parse=int, unit="days",
            doc="maintenance deletes django-q2's own task rows (failures) older than this"),
)
