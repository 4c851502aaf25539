from django.apps import AppConfig


class TasksConfig(AppConfig):
    """Fairshare as a Django Tasks backend (tasks/backend.py). Its system checks run through the
    backend's `check()`, which the Tasks framework calls for every configured backend."""

    name = "tasks"
    verbose_name = "Django tasks"
