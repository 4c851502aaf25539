from django.urls import path

from exports import api, views

app_name = "exports"
urlpatterns = [
    path("accounts/<slug:slug>/exports/", api.request_export, name="request"),
    path("exports/<uuid:export_id>/", api.export_detail, name="detail"),
    path("exports/<uuid:export_id>/download/", api.export_download, name="download"),
    path("exports/<uuid:export_id>/retry/", api.retry_export, name="retry"),
    path("exports/file/<str:token>/", views.export_file, name="file"),
]
