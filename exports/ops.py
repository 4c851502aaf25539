"""Exports' contributions to /metrics and /healthz (see scheduling.monitoring): exports by status,
what stored exports hold, and whether export storage takes a write."""
import uuid

from django.core.files.base import ContentFile
from django.db.models import Count, Sum
from prometheus_client.core import GaugeMetricFamily

from exports.models import ExportRecord, ExportStatus
from exports.storage import export_storage
from scheduling import monitoring


@monitoring.metrics
def export_metrics():
    exported = ExportRecord.objects.filter(status=ExportStatus.SUCCEEDED).aggregate(
        rows=Sum("row_count"), size=Sum("byte_size"), n=Count("pk"))
    yield GaugeMetricFamily("fairshare_exports_retained", "Succeeded exports still stored", value=exported["n"])
    yield GaugeMetricFamily("fairshare_export_rows_retained", "Rows in stored exports", value=exported["rows"] or 0)
    yield GaugeMetricFamily("fairshare_export_bytes_retained", "Bytes of stored exports", value=exported["size"] or 0)
    by_status = GaugeMetricFamily("fairshare_exports", "Exports by status", labels=["status"])
    for row in ExportRecord.objects.values("status").annotate(n=Count("pk")).order_by():
        by_status.add_metric([row["status"]], row["n"])
    yield by_status


@monitoring.health_check("export_storage")
def export_storage_writable() -> str | None:
    """A probe object written and deleted again."""
    storage = export_storage()
    name = f"healthz/{uuid.uuid4().hex}.probe"
    try:
        saved = storage.save(name, ContentFile(b"ok"))
        storage.delete(saved)
    except Exception as exc:
        return f"not writable ({type(exc).__name__})"
    return None
