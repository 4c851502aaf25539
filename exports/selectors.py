"""Reads of the exports app shared by the admin, the API, the commands and the jobs."""
from django.db.models import QuerySet

from exports.models import ExportRecord


def exports_visible_to(*, user) -> QuerySet[ExportRecord]:
    """Exports of the accounts the user belongs to (any role); superusers see all."""
    if user is None or not user.is_authenticated or not user.is_active:
        return ExportRecord.objects.none()
    if user.is_superuser:
        return ExportRecord.objects.all()
    return ExportRecord.objects.filter(account__memberships__user=user)
