from django.contrib import admin
from django.urls import include, path

from scheduling import views as ops
from scheduling.dashboard import dashboard

urlpatterns = [
    path("admin/dashboard/", dashboard, name="ops-dashboard"),
    path("admin/", admin.site.urls),
    path("api/", include("exports.urls")),
    path("metrics", ops.metrics, name="metrics"),
    path("healthz", ops.healthz, name="healthz"),
]
