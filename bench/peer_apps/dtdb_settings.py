"""The smallest Django project for django-tasks-db in bench/peers.py (its own virtualenv): the
database backend, persistent connections (CONN_MAX_AGE 60), DEBUG off."""
import os
from urllib.parse import unquote, urlsplit

_url = urlsplit(os.environ["PEERS_DATABASE_URL"])

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
INSTALLED_APPS = ["django_tasks", "django_tasks_db"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(_url.path.lstrip("/")),
        "USER": unquote(_url.username or ""),
        "PASSWORD": unquote(_url.password or ""),
        "HOST": _url.hostname or "127.0.0.1",
        "PORT": _url.port or 5432,
        "CONN_MAX_AGE": 60,
    },
}
TASKS = {"default": {"BACKEND": "django_tasks_db.DatabaseBackend"}}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
