from django.contrib import admin

from budgets.admin import ReadOnlyAdmin
from scheduling.models import TaskRun


@admin.register(TaskRun)
class TaskRunAdmin(ReadOnlyAdmin):
    list_display = ["job", "account", "outcome", "started_at", "wall_ms", "cpu_ms", "db_wait_ms",
                    "storage_wait_ms", "items", "worker"]
    list_filter = ["outcome", "job", "queue", "account"]
    search_fields = ["ref", "job", "worker"]
    date_hierarchy = "started_at"
    list_select_related = ["account"]
    show_full_result_count = False
