"""Operations endpoints: /metrics (Prometheus text) and /healthz."""
import ipaddress
import uuid
from http import HTTPStatus

from django.conf import settings
from django.core.files.base import ContentFile
from django.db import connection
from django.http import HttpResponse, JsonResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from budgets.models import Queue
from exports.storage import export_storage
from scheduling.liveness import queue_health, queue_problem
from scheduling.metrics import FairshareCollector


def _metrics_allowed(request) -> bool:
    """Metrics name accounts: only for the bearer token or an allowed network."""
    token = settings.FAIRSHARE["METRICS_TOKEN"]
    header = request.headers.get("Authorization", "")
    if token and header.startswith("Bearer ") and constant_time_compare(header[7:].strip(), token):
        return True
    try:
        client = ipaddress.ip_address(request.META.get("REMOTE_ADDR", ""))
    except ValueError:
        return False
    networks = [n for n in settings.FAIRSHARE["METRICS_ALLOWED_NETWORKS"].split(",") if n.strip()]
    return any(client in ipaddress.ip_network(n.strip(), strict=False) for n in networks)


@never_cache
@require_GET
def metrics(request):
    if not _metrics_allowed(request):
        return HttpResponse("Forbidden\n", status=HTTPStatus.FORBIDDEN, content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FairshareCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


def _check_database() -> str | None:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:
        return f"unreachable ({type(exc).__name__})"
    return None


def _check_workers() -> dict[str, str | None]:
    try:
        health = queue_health()
    except Exception as exc:
        return {q: f"unknown ({type(exc).__name__})" for q in Queue.values}
    return {h.queue: queue_problem(h) for h in health}


def _check_storage() -> str | None:
    storage = export_storage()
    name = f"healthz/{uuid.uuid4().hex}.probe"
    try:
        saved = storage.save(name, ContentFile(b"ok"))
        storage.delete(saved)
    except Exception as exc:
        return f"not writable ({type(exc).__name__})"
    return None


@never_cache
@require_GET
def healthz(request):
    """200 when the database, each queue's workers (heard from recently, and not stalled: see
    scheduling/liveness.py) and export storage are fine; 503 naming what is not."""
    checks = {"database": _check_database()}
    for queue, problem in _check_workers().items():
        checks[f"workers:{queue}"] = problem
    checks["export_storage"] = _check_storage()
    failing = {name: problem for name, problem in checks.items() if problem}
    body = {"status": "fail" if failing else "ok", "checks": {n: p or "ok" for n, p in checks.items()}}
    return JsonResponse(body, status=HTTPStatus.SERVICE_UNAVAILABLE if failing else HTTPStatus.OK)
