from django.contrib import admin
from django.urls import include, path

from budgets import views as budget_views
from scheduling import views as ops
from scheduling.dashboard import dashboard, dashboard_panel

urlpatterns = [
    path("admin/dashboard/", dashboard, name="ops-dashboard"),
    path("admin/dashboard/panels/<slug:name>/", dashboard_panel, name="ops-dashboard-panel"),
    path("admin/fairshare/", budget_views.fair_share, name="ops-fairshare"),
    path("admin/fairshare/table/", budget_views.fair_share_table, name="ops-fairshare-table"),
    path("admin/", admin.site.urls),
    path("api/", include("exports.urls")),
    path("metrics", ops.metrics, name="metrics"),
    path("healthz", ops.healthz, name="healthz"),
]
