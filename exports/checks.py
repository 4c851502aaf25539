"""System checks for the exports app's settings (registered in ExportsConfig.ready)."""
from django.conf import settings
from django.core import checks

from exports.streaming import resolve_strategy
from scheduling.conf import clusters
from scheduling.registry import get_job


def check_attempt_deadline(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """An attempt must give up by itself before django-q2 kills it."""
    queue = get_job("exports.build").queue
    timeout = clusters(settings.Q_CLUSTER).get(queue, {}).get("timeout")  # no cluster: scheduling.E002
    deadline = settings.FAIRSHARE["EXPORT_ATTEMPT_DEADLINE_S"]
    if timeout is not None and deadline >= timeout:
        return [checks.Error(
            f'FAIRSHARE["EXPORT_ATTEMPT_DEADLINE_S"] ({deadline} s) must be shorter than the {queue} '
            f"queue's timeout ({timeout} s).",
            hint="An attempt past its deadline stops cleanly between batches and records why; django-q2 "
                 "kills one still running at the timeout with nothing recorded, and its claim and slot wait "
                 "for their leases to expire. Set FAIRSHARE_EXPORT_ATTEMPT_DEADLINE below "
                 "FAIRSHARE_EXPORT_TIMEOUT.",
            id="exports.E001")]
    return []


def check_stream_strategy(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    try:
        resolve_strategy()
    except ValueError as exc:
        return [checks.Error(
            f'FAIRSHARE["EXPORT_STREAM"]: {exc}.',
            hint="Set FAIRSHARE_EXPORT_STREAM to auto, copy, cursor or orm; every export would fail until then.",
            id="exports.E002")]
    return []
