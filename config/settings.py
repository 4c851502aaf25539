"""Fairshare settings, read from the environment (12-factor).

The defaults run the zero-setup demo: SQLite, local export files, django-q2's ORM broker.
Production sets DATABASE_URL (PostgreSQL), SECRET_KEY and, optionally, REDIS_URL and S3.
"""
import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured


def env_bool(name: str, default: bool = False) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "yes", "on"}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


BASE_DIR = Path(__file__).resolve().parent.parent
# Everything the demo writes (SQLite file, export objects, logs) lives under one folder.
VAR_DIR = Path(os.environ.get("FAIRSHARE_VAR_DIR", BASE_DIR / "var"))

DEBUG = env_bool("DEBUG")
SECRET_KEY = os.environ.get("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = "insecure-demo-key-only-for-debug"

ALLOWED_HOSTS = [h for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]
if DEBUG:
    ALLOWED_HOSTS += ["testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_q",
    "budgets",
    "exports",
    "scheduling",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- Database -------------------------------------------------------------------------------
DATABASES = {
    # Persistent connections, checked before reuse: django-q2 calls close_old_connections() around
    # every task in every worker and in the monitor, which with CONN_MAX_AGE = 0 means a new
    # database connection per task; the health check also replaces a connection that died while
    # idle before a task uses it.
    "default": dj_database_url.config(
        default=f"sqlite:///{VAR_DIR / 'fairshare.sqlite3'}",
        conn_max_age=env_int("FAIRSHARE_DB_CONN_MAX_AGE", 60), conn_health_checks=True,
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    Path(DATABASES["default"]["NAME"]).parent.mkdir(parents=True, exist_ok=True)
    # The demo runs a web server and two qclusters on one SQLite file: take the write lock at
    # BEGIN (no upgrade deadlocks) and wait for it rather than failing with "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 30,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = VAR_DIR / "static"

# --- Export storage -------------------------------------------------------------------------
# Local files by default; S3 through django-storages when FAIRSHARE_EXPORTS_S3_BUCKET is set.
if os.environ.get("FAIRSHARE_EXPORTS_S3_BUCKET"):
    EXPORTS_STORAGE = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": os.environ["FAIRSHARE_EXPORTS_S3_BUCKET"],
            "endpoint_url": os.environ.get("FAIRSHARE_EXPORTS_S3_ENDPOINT_URL") or None,
            "region_name": os.environ.get("FAIRSHARE_EXPORTS_S3_REGION") or None,
            "default_acl": "private",
            "querystring_auth": True,
            "file_overwrite": True,
        },
    }
else:
    EXPORTS_STORAGE = {
        # Any FileSystemStorage subclass (the test suite points this at a failing one).
        "BACKEND": os.environ.get("FAIRSHARE_EXPORTS_STORAGE_BACKEND", "django.core.files.storage.FileSystemStorage"),
        # The key of an export is deterministic: a second publish must replace, never rename.
        "OPTIONS": {
            "location": os.environ.get("FAIRSHARE_EXPORTS_ROOT", str(VAR_DIR / "exports")),
            "allow_overwrite": True,
            "file_permissions_mode": 0o600,
        },
    }
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "exports": EXPORTS_STORAGE,
}

# --- Task queues (django-q2) ----------------------------------------------------------------
# Two queues from the start, each served by its own `qcluster` pool:
#   python manage.py qcluster                          -> "default"
#   Q_CLUSTER_NAME=exports python manage.py qcluster   -> "exports"
# `retry` must exceed `timeout`: the ORM broker redelivers an unacknowledged task after `retry`
# seconds even while it is still running (see docs/architecture.md).
TASK_TIMEOUT_S = env_int("FAIRSHARE_TASK_TIMEOUT", 300)
EXPORT_TIMEOUT_S = env_int("FAIRSHARE_EXPORT_TIMEOUT", 1800)
EXPORT_RETRY_S = env_int("FAIRSHARE_EXPORT_RETRY", EXPORT_TIMEOUT_S + 60)
if EXPORT_RETRY_S <= EXPORT_TIMEOUT_S:
    raise ImproperlyConfigured("FAIRSHARE_EXPORT_RETRY must be larger than FAIRSHARE_EXPORT_TIMEOUT.")
_broker = (
    {"redis": os.environ["REDIS_URL"]} if os.environ.get("REDIS_URL")
    # django-q2's ORM broker, first in first out (see scheduling/broker.py).
    else {"orm": "default", "broker_class": "scheduling.broker.FifoORM"}
)
Q_CLUSTER = {
    "name": "default",
    "workers": env_int("FAIRSHARE_WORKERS", 2),
    "timeout": TASK_TIMEOUT_S,
    "retry": TASK_TIMEOUT_S + 60,
    "max_attempts": 3,
    # Our own TaskRun records every run; keeping django-q2 success rows only costs locks.
    "save_limit": -1,
    "poll": float(os.environ.get("FAIRSHARE_POLL", 0.5)),
    "catch_up": False,
    "label": "Task queue",
    **_broker,
    "ALT_CLUSTERS": {
        "exports": {
            "workers": env_int("FAIRSHARE_EXPORT_WORKERS", 2),
            "timeout": EXPORT_TIMEOUT_S,
            "retry": EXPORT_RETRY_S,
        },
    },
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    Q_CLUSTER["workers"] = min(Q_CLUSTER["workers"], 1)

# --- Fairshare ------------------------------------------------------------------------------
FAIRSHARE = {
    # Outer to inner, like MIDDLEWARE: each entry wraps everything below it.
    "TASK_MIDDLEWARE": [
        "scheduling.middleware.ContractMiddleware",
        "scheduling.middleware.RunRecordingMiddleware",
        "budgets.middleware.BudgetMiddleware",
        "scheduling.middleware.RetryMiddleware",
    ],
    # Each worker releases due held work this often, so a 2-second back-off is not held up by
    # django-q2's 30-second scheduler tick.
    "RELEASE_POLL_S": float(os.environ.get("FAIRSHARE_RELEASE_POLL", 1)),
    # Job modules outside INSTALLED_APPS' `jobs.py` (comma-separated), e.g. the test suite's.
    "EXTRA_JOB_MODULES": [m for m in os.environ.get("FAIRSHARE_EXTRA_JOB_MODULES", "").split(",") if m],
    "EXPORT_MAX_RANGE_DAYS": env_int("FAIRSHARE_EXPORT_MAX_RANGE_DAYS", 366),
    "EXPORT_MAX_ROWS": env_int("FAIRSHARE_EXPORT_MAX_ROWS", 5_000_000),
    "EXPORT_BATCH_ROWS": env_int("FAIRSHARE_EXPORT_BATCH_ROWS", 10_000),
    # "copy" (PostgreSQL COPY ... TO STDOUT), "cursor" (server-side cursor) or "auto".
    "EXPORT_STREAM": os.environ.get("FAIRSHARE_EXPORT_STREAM", "auto"),
    "EXPORT_LEASE_S": env_int("FAIRSHARE_EXPORT_LEASE", 120),
    # Each attempt's overall deadline (checked between batches); below the queue's timeout.
    "EXPORT_ATTEMPT_DEADLINE_S": env_int("FAIRSHARE_EXPORT_ATTEMPT_DEADLINE", 1500),
    # The reconciler re-sends a queued export nobody is running or holding after this long.
    "EXPORT_STALE_AFTER_S": env_int("FAIRSHARE_EXPORT_STALE_AFTER", 120),
    "EXPORT_DOWNLOAD_TTL_S": env_int("FAIRSHARE_EXPORT_DOWNLOAD_TTL", 15 * 60),
    "EXPORT_RETENTION_DAYS": env_int("FAIRSHARE_EXPORT_RETENTION_DAYS", 7),
    "BUDGET_DAY_TIMEZONE": os.environ.get("FAIRSHARE_BUDGET_DAY_TIMEZONE", "UTC"),
    # Shifts the budget clock only (tests and rehearsals); never set in production.
    "CLOCK_OFFSET_S": env_int("FAIRSHARE_CLOCK_OFFSET", 0),
    # A running task's reservation and slot are reclaimed when its worker stops heart-beating
    # for this long (the worker died); heartbeats come every RESERVATION_HEARTBEAT_S.
    "RESERVATION_LEASE_S": env_int("FAIRSHARE_RESERVATION_LEASE", 60),
    "RESERVATION_HEARTBEAT_S": float(os.environ.get("FAIRSHARE_RESERVATION_HEARTBEAT", 5)),
    # A run reserves CPU in steps of this much (at least its job's estimate) and reserves the next
    # step when less than half of one is left; the runs of an account never hold more than it has
    # left today, so together they stop at the daily cap. Each run's heartbeat thread looks at its
    # CPU this often: the most a job that never checks its budget overshoots by.
    "RESERVATION_STEP_MS": env_int("FAIRSHARE_RESERVATION_STEP", 1000),
    "BUDGET_TICK_S": float(os.environ.get("FAIRSHARE_BUDGET_TICK", 0.2)),
    # A job sent to the broker holds one of its account's slots until it starts; if its message
    # is lost (a broker restart), the slot is given back after this long.
    "DISPATCH_LEASE_S": env_int("FAIRSHARE_DISPATCH_LEASE", 300),
    # Maintenance: task runs older than this are rolled up per day and pruned; django-q2's own
    # task rows (failures) older than this are deleted.
    "TASK_RUN_RETENTION_DAYS": env_int("FAIRSHARE_TASK_RUN_RETENTION_DAYS", 14),
    "DJANGO_Q_RETENTION_DAYS": env_int("FAIRSHARE_DJANGO_Q_RETENTION_DAYS", 7),
    # /metrics: a bearer token, or a client address in these networks (comma-separated CIDRs).
    "METRICS_TOKEN": os.environ.get("FAIRSHARE_METRICS_TOKEN", ""),
    "METRICS_ALLOWED_NETWORKS": os.environ.get("FAIRSHARE_METRICS_ALLOWED_NETWORKS", "127.0.0.1/32,::1/128"),
    # /healthz: a queue is healthy when one of its workers was heard from this recently.
    "HEALTH_HEARTBEAT_MAX_AGE_S": env_int("FAIRSHARE_HEALTH_HEARTBEAT_MAX_AGE", 60),
    "WORKER_HEARTBEAT_S": env_int("FAIRSHARE_WORKER_HEARTBEAT", 10),
    # /healthz and /metrics: a queue is stalled when a message waited this long, no task of the
    # queue started for as long and none is running - its workers beat but do no work.
    "QUEUE_STALL_AFTER_S": float(os.environ.get("FAIRSHARE_QUEUE_STALL_AFTER_S", 120)),
    # Default budgets per plan tier and queue: daily CPU seconds and concurrent tasks.
    # An operator can override them per account (budgets.Budget).
    "PLAN_BUDGETS": {
        "free": {"default": {"cpu_seconds_per_day": 600, "max_concurrent": 1},
                 "exports": {"cpu_seconds_per_day": 300, "max_concurrent": 1}},
        "standard": {"default": {"cpu_seconds_per_day": 3600, "max_concurrent": 2},
                     "exports": {"cpu_seconds_per_day": 1800, "max_concurrent": 1}},
        "enterprise": {"default": {"cpu_seconds_per_day": 36000, "max_concurrent": 8},
                       "exports": {"cpu_seconds_per_day": 18000, "max_concurrent": 4}},
    },
}

# JSON lines in production (LOG_FORMAT=json, the default without DEBUG), readable text in the demo.
LOG_FORMAT = os.environ.get("LOG_FORMAT", "text" if DEBUG else "json")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "config.logging.JsonFormatter"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT}},
    "root": {"handlers": ["console"], "level": os.environ.get("LOG_LEVEL", "INFO")},
    "loggers": {"django_q": {"level": os.environ.get("Q_LOG_LEVEL", "INFO")}},
}

EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
# Where django.core.mail.backends.filebased.EmailBackend writes messages (one file per connection).
EMAIL_FILE_PATH = os.environ.get("EMAIL_FILE_PATH") or None
LOGIN_URL = "admin:login"
