"""Operations endpoints: /metrics (Prometheus text) and /healthz, serving what each app
contributes from its `ops.py` (scheduling.monitoring)."""
import ipaddress
from http import HTTPStatus

from django.conf import settings
from django.http import HttpResponse, JsonResponse
from django.utils.crypto import constant_time_compare
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from scheduling import monitoring


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


class _Contributions:
    """A prometheus_client collector over every app's registered metric families."""

    def collect(self):
        return monitoring.collect_metrics()


@never_cache
@require_GET
def metrics(request):
    if not _metrics_allowed(request):
        return HttpResponse("Forbidden\n", status=HTTPStatus.FORBIDDEN, content_type="text/plain")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Contributions())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)


@never_cache
@require_GET
def healthz(request):
    """200 when every contributed check is fine (the database, each queue's workers - heard from
    recently and not stalled, see scheduling/liveness.py - export storage, …); 503 naming what is
    not."""
    checks = monitoring.run_health_checks()
    failing = {name: problem for name, problem in checks.items() if problem}
    body = {"status": "fail" if failing else "ok", "checks": {n: p or "ok" for n, p in checks.items()}}
    return JsonResponse(body, status=HTTPStatus.SERVICE_UNAVAILABLE if failing else HTTPStatus.OK)
