"""System checks for the kernel's settings (registered in SchedulingConfig.ready).

An Error stops `manage.py check`, `migrate`, `runserver` and `qcluster` (django-q2's command keeps
Django's default `requires_system_checks`), so a worker never starts with a broken invariant.
"""
import ipaddress

from django.conf import settings
from django.core import checks

from budgets.models import Queue
from scheduling.conf import clusters
from scheduling.envelope import known_version


def check_clusters(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Every queue has a cluster, and each cluster redelivers only after its timeout."""
    found = clusters(settings.Q_CLUSTER)
    errors = [
        checks.Error(f'No Q_CLUSTER cluster serves the "{queue}" queue.',
              hint='Its jobs would never run. Add it to Q_CLUSTER["ALT_CLUSTERS"].',
              id="scheduling.E002")
        for queue in Queue.values if queue not in found
    ]
    for name, options in found.items():
        timeout, retry = options.get("timeout"), options.get("retry")
        if timeout is not None and retry is not None and retry <= timeout:
            errors.append(checks.Error(
                f'Q_CLUSTER cluster "{name}": retry ({retry} s) must be larger than timeout ({timeout} s).',
                hint="django-q2 delivers a task again once `retry` seconds pass without an "
                     "acknowledgement, even while it still runs: a task running past `retry` would run "
                     "twice at once. For the exports queue, set FAIRSHARE_EXPORT_RETRY above "
                     "FAIRSHARE_EXPORT_TIMEOUT.",
                id="scheduling.E001"))
    return errors


def check_pulse(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """/healthz must not call a live queue dead between two of its workers' heartbeats."""
    options = settings.FAIRSHARE
    poll, beat, max_age = (options["RELEASE_POLL_S"], options["WORKER_HEARTBEAT_S"],
                           options["HEALTH_HEARTBEAT_MAX_AGE_S"])
    if poll <= 0:
        return [checks.Warning(
            f'FAIRSHARE["RELEASE_POLL_S"] is {poll:g}: workers run no pulse.',
            hint="Held work then waits for django-q2's scheduler (about 30 s) and no worker writes a "
                 "heartbeat, so /healthz reports every queue down. Set FAIRSHARE_RELEASE_POLL above 0.",
            id="scheduling.W001")]
    if max_age <= beat + poll:
        return [checks.Error(
            f'FAIRSHARE["HEALTH_HEARTBEAT_MAX_AGE_S"] ({max_age} s) must be larger than WORKER_HEARTBEAT_S '
            f"+ RELEASE_POLL_S ({beat + poll:g} s).",
            hint="A worker's pulse writes its heartbeat about that often, so /healthz would report a live "
                 "queue down between two heartbeats. Raise FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE or lower "
                 "FAIRSHARE_WORKER_HEARTBEAT.",
            id="scheduling.E003")]
    return []


def check_stall_threshold(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A message waits up to a poll before even an idle worker fetches it: no alarm for that."""
    stall_after = settings.FAIRSHARE["QUEUE_STALL_AFTER_S"]
    slowest_poll = max(c.get("poll", 0) for c in clusters(settings.Q_CLUSTER).values())
    if stall_after <= slowest_poll:
        return [checks.Error(
            f'FAIRSHARE["QUEUE_STALL_AFTER_S"] ({stall_after:g} s) must be larger than the slowest queue\'s '
            f"poll ({slowest_poll:g} s).",
            hint="A message waits up to a poll before an idle worker fetches it, so /healthz would report "
                 "a working queue stalled. Raise FAIRSHARE_QUEUE_STALL_AFTER_S.",
            id="scheduling.E005")]
    exit_after = settings.FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"]
    if exit_after and exit_after <= stall_after:
        return [checks.Error(
            f'FAIRSHARE["STALLED_POOL_EXIT_AFTER_S"] ({exit_after:g} s) must be larger than '
            f'FAIRSHARE["QUEUE_STALL_AFTER_S"] ({stall_after:g} s), or 0.',
            hint="A stuck pool would end itself before /healthz and fairshare_queue_stalled have said it is "
                 "stuck. Raise FAIRSHARE_STALLED_POOL_EXIT_AFTER_S.",
            id="scheduling.E009")]
    return []


def check_metrics_networks(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    errors = []
    for network in settings.FAIRSHARE["METRICS_ALLOWED_NETWORKS"].split(","):
        try:
            ipaddress.ip_network(network.strip(), strict=False)
        except ValueError:
            if network.strip():
                errors.append(checks.Error(
                    f'FAIRSHARE["METRICS_ALLOWED_NETWORKS"]: {network.strip()!r} is not a network.',
                    hint="Give comma-separated CIDRs in FAIRSHARE_METRICS_ALLOWED_NETWORKS, e.g. "
                         "127.0.0.1/32,10.0.0.0/8; until then /metrics fails for clients without the token.",
                    id="scheduling.E004"))
    return errors


def check_logging_redacts(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Every log handler a logging configuration installed (LOGGING, Django's DEFAULT_LOGGING:
    dictConfig names them) redacts (SPEC §5: no credential in a log line). Unnamed handlers are
    a program's own, attached at run time (a test runner's capture, for one)."""
    import logging

    from scheduling.redaction import RedactingFilter

    loggers = [logging.getLogger()] + [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)]
    bare = sorted({
        f"{logger.name or 'root'}: {handler.name}"
        for logger in loggers for handler in getattr(logger, "handlers", [])
        if handler.name and not isinstance(handler, logging.NullHandler)
        and not any(isinstance(f, RedactingFilter) for f in handler.filters)
    })
    if not bare:
        return []
    return [checks.Error(
        f"Log handlers without redaction: {', '.join(bare)}.",
        hint='Add "filters": ["redact"] to the handler in LOGGING (config/settings.py).', id="scheduling.E006")]


def check_envelope_version(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Producers send a version this code can build: 1 up to the newest it speaks."""
    sent, newest = settings.FAIRSHARE["ENVELOPE_VERSION"], known_version()
    if not 1 <= sent <= newest:
        return [checks.Error(
            f'FAIRSHARE["ENVELOPE_VERSION"] is {sent}: this code speaks envelope versions 1 to {newest}.',
            hint="Unset FAIRSHARE_ENVELOPE_VERSION (the newest), or pin the version the oldest worker still "
                 "running speaks during a rolling upgrade (docs/deploy.md).",
            id="scheduling.E007")]
    return []


def check_database_timeouts(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """A frozen lock holder's session must end before its waiters give up (so a freeze delays work
    and fails none), and a statement's lock wait counts against its statement timeout."""
    timeouts = getattr(settings, "DATABASE_SESSION_TIMEOUTS_S", {})
    idle, lock, statement = (timeouts.get(name, 0) for name in (
        "idle_in_transaction_session_timeout", "lock_timeout", "statement_timeout"))
    errors = []
    if idle and lock and lock <= idle:
        errors.append(checks.Error(
            f"FAIRSHARE_DB_LOCK_TIMEOUT_S ({lock} s) must be larger than FAIRSHARE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S "
            f"({idle} s).",
            hint="Workers waiting for a lock that a frozen process holds would fail before the server ends the "
                 "frozen session and frees the lock.",
            id="scheduling.E008"))
    if statement and lock and statement <= lock:
        errors.append(checks.Error(
            f"FAIRSHARE_DB_STATEMENT_TIMEOUT_S ({statement} s) must be larger than FAIRSHARE_DB_LOCK_TIMEOUT_S "
            f"({lock} s), or 0.",
            hint="Time spent waiting for a lock counts against the statement timeout: it would fire first.",
            id="scheduling.E008"))
    return errors
