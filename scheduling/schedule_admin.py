"""django-q2's schedules in the admin, with their last run from our own TaskRun records:
with `save_limit: -1` django-q2 keeps no success rows, so its own "last run" stays empty."""
from django.contrib import admin
from django.db.models import OuterRef, Subquery, Value
from django.db.models.functions import Concat, Substr
from django_q import admin as q_admin
from django_q.models import Schedule

from scheduling.actions import run_schedule_now
from scheduling.models import TaskRun
from scheduling.operator import message_results
from scheduling.schedules import PREFIX


class ScheduleAdmin(q_admin.ScheduleAdmin):
    list_display = ("id", "name", "func", "schedule_type", "cron", "cluster", "next_run", "last_run",
                    "last_outcome", "last_duration", "get_last_run", "get_success")
    actions = ["run_now"]

    def get_queryset(self, request):
        # A Fairshare schedule fires its job with ref "schedule:<name>" (scheduling.schedules).
        runs = TaskRun.objects.filter(ref=OuterRef("run_ref")).order_by("-started_at")
        return super().get_queryset(request).annotate(
            run_ref=Concat(Value("schedule:"), Substr("name", len(PREFIX) + 1)),
            last_started_at=Subquery(runs.values("started_at")[:1]),
            last_run_outcome=Subquery(runs.values("outcome")[:1]),
            last_wall_ms=Subquery(runs.values("wall_ms")[:1]),
        )

    @admin.display(description="last run (our records)", ordering="last_started_at")
    def last_run(self, obj):
        return obj.last_started_at

    @admin.display(description="outcome")
    def last_outcome(self, obj):
        return obj.last_run_outcome or "—"

    @admin.display(description="duration")
    def last_duration(self, obj):
        return "—" if obj.last_wall_ms is None else f"{obj.last_wall_ms / 1000:.2f} s"

    @admin.action(description="Run now (once; the timetable is unchanged)")
    def run_now(self, request, queryset):
        message_results(self, request, [run_schedule_now(user=request.user, schedule_id=pk)
                                        for pk in queryset.values_list("pk", flat=True)])


if admin.site.is_registered(Schedule):
    admin.site.unregister(Schedule)
admin.site.register(Schedule, ScheduleAdmin)
