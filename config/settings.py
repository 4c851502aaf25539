"""Fairshare settings, read from the environment (12-factor).

Fairshare runs on PostgreSQL only: DATABASE_URL names it (a URL of another database is refused
here, at start-up). Production sets DATABASE_URL, SECRET_KEY and, optionally, REDIS_URL and S3;
the demo (scripts/demo) runs an embedded PostgreSQL under var/, local export files and django-q2's
ORM broker, and leaves its settings in var/demo.env for commands typed beside it (config/demo_env.py:
read only by a process whose environment names no database, and never over its environment).

Every variable read here is declared once, with its default and meaning: this file's own in
config/env.py, each app's FAIRSHARE keys in `<app>/conf.py`, the test-only seams in
scheduling/testing.py; README.md's configuration table is generated from those declarations.
Invariants between settings (retry > timeout, ...) are system checks in `<app>/checks.py`:
`manage.py check`, `migrate`, `runserver` and `qcluster` refuse to start while one fails.
"""
from pathlib import Path

import django

from django.core.exceptions import ImproperlyConfigured

from budgets import conf as budgets_conf
from config import database, demo_env, env
from exports import conf as exports_conf
from scheduling import conf as scheduling_conf
from scheduling import testing
from tasks import conf as tasks_conf
from usage import conf as usage_conf

# Before anything reads a seam: FAIRSHARE_FAULT & co. are refused outside the test suite.
testing.refuse_seams_unless_testing()

BASE_DIR = Path(__file__).resolve().parent.parent
# Everything the demo writes (its PostgreSQL's data, export files, logs) lives under one folder.
VAR_DIR = Path(env.VAR_DIR.read(default=BASE_DIR / "var"))
# Before any other variable is read: a running demo's settings, for a command typed beside it, unless
# this process's environment names its own database (config/demo_env.py says why).
demo_env.apply(VAR_DIR)

DEBUG = env.DEBUG.read()
SECRET_KEY = env.SECRET_KEY.read()
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = "insecure-demo-key-only-for-debug"
# Django's key rotation: what was signed with these is still accepted (workers: scheduling/signatures.py).
SECRET_KEY_FALLBACKS = env.SECRET_KEY_FALLBACKS.read()

ALLOWED_HOSTS = env.ALLOWED_HOSTS.read()
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
    # The Django Tasks framework: the django-tasks backport on Django 5.2, Django's own from 6.
    *tasks_conf.framework_apps(),
    "budgets",
    "exports",
    "scheduling",
    "tasks",
    "usage",
]

MIDDLEWARE = [
    # Outermost: every error answer on an /api/ path is JSON, whichever layer made it.
    "exports.errors.ApiJsonErrorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# HTTPS: on by default unless DEBUG (config/env.py says why); each part can be turned off from the
# environment. The demo (DEBUG=1) and the test suite (tests/conftest.py) speak plain HTTP on loopback.
SECURE_SSL_REDIRECT = env.SSL_REDIRECT.read(default=not DEBUG)
SECURE_HSTS_SECONDS = env.HSTS_SECONDS.read(default=0 if DEBUG else env.HSTS_SECONDS_WITHOUT_DEBUG)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.HSTS_INCLUDE_SUBDOMAINS.read(default=not DEBUG)
SECURE_HSTS_PRELOAD = env.HSTS_PRELOAD.read(default=not DEBUG)
SESSION_COOKIE_SECURE = env.SESSION_COOKIE_SECURE.read(default=not DEBUG)
CSRF_COOKIE_SECURE = env.CSRF_COOKIE_SECURE.read(default=not DEBUG)
# Probes and scrapers ask these over plain HTTP from inside the network (a load balancer, the
# kubelet, Prometheus, the `curl -sf .../healthz` of docs/deploy.md): a 301 would count as healthy
# for them and hide a 503. Neither page sets a cookie or reads a session.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
if env.PROXY_SSL_HEADER.read():
    _header, _, _value = env.PROXY_SSL_HEADER.read().partition("=")
    if not _value:
        raise ImproperlyConfigured("SECURE_PROXY_SSL_HEADER must look like HTTP_X_FORWARDED_PROTO=https.")
    SECURE_PROXY_SSL_HEADER = (_header.strip(), _value.strip())

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

# --- Database (config/database.py) --------------------------------------------------------
DATABASE_SESSION_TIMEOUTS_S = database.session_timeouts()
DATABASES = database.databases(var_dir=VAR_DIR, timeouts=DATABASE_SESSION_TIMEOUTS_S)
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
def s3_exports_storage(*, bucket: str, endpoint_url: str | None, region: str | None) -> dict:
    """STORAGES["exports"] on S3 (the test suite builds its own bucket's with this too).
    Credentials come the standard AWS way: environment, shared config, instance role."""
    return {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": bucket,
            "endpoint_url": endpoint_url or None,
            "region_name": region or None,
            "default_acl": "private",
            "querystring_auth": True,
            # Requests signed with SigV4 (every region accepts it; SigV2 is retired).
            "signature_version": "s3v4",
            "file_overwrite": True,
        },
    }


if env.EXPORTS_S3_BUCKET.read():
    EXPORTS_STORAGE = s3_exports_storage(bucket=env.EXPORTS_S3_BUCKET.read(),
                                         endpoint_url=env.EXPORTS_S3_ENDPOINT_URL.read(),
                                         region=env.EXPORTS_S3_REGION.read())
else:
    EXPORTS_STORAGE = {
        # Any FileSystemStorage subclass (the test suite points this at a failing one).
        "BACKEND": env.EXPORTS_STORAGE_BACKEND.read(),
        # The key of an export is deterministic: a second publish must replace, never rename.
        "OPTIONS": {
            "location": env.EXPORTS_ROOT.read(default=str(VAR_DIR / "exports")),
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
# seconds even while it is still running (see docs/architecture.md; system check scheduling.E001).
TASK_TIMEOUT_S = env.TASK_TIMEOUT.read()
EXPORT_TIMEOUT_S = env.EXPORT_TIMEOUT.read()
# The broker: the ORM by default, Redis with REDIS_URL, RabbitMQ with RABBITMQ_URL (README "Which
# broker"). Unset here when unused: scheduling.amqp reads it. The ORM and Redis brokers check every
# message's signature against SECRET_KEY and SECRET_KEY_FALLBACKS (scheduling/signatures.py).
RABBITMQ_URL = env.RABBITMQ_URL.read()
if RABBITMQ_URL and env.REDIS_URL.read():
    raise ImproperlyConfigured("Set REDIS_URL or RABBITMQ_URL, not both: each names the broker of every queue.")
if RABBITMQ_URL:
    # Not signature-checked as the others: its consumer dead-letters a message this deployment's
    # SECRET_KEY does not verify, with its reason (scheduling/rabbitmq_pusher.py).
    _broker = {"broker_class": "scheduling.rabbitmq.RabbitMQ"}
elif env.REDIS_URL.read():
    _broker = {"redis": env.REDIS_URL.read(), "broker_class": "scheduling.signatures.VerifiedRedis"}
else:
    # django-q2's ORM broker, first in first out (see scheduling/broker.py).
    _broker = {"orm": "default", "broker_class": "scheduling.signatures.VerifiedFifoORM"}
Q_CLUSTER = {
    "name": "default",
    "workers": env.WORKERS.read(),
    "timeout": TASK_TIMEOUT_S,
    "retry": TASK_TIMEOUT_S + 60,
    "max_attempts": 3,
    # Our own TaskRun records every run; keeping django-q2 success rows only costs locks.
    "save_limit": -1,
    "poll": env.POLL.read(),
    "catch_up": False,
    "label": "Task queue",
    **_broker,
    "ALT_CLUSTERS": {
        "exports": {
            "workers": env.EXPORT_WORKERS.read(),
            "timeout": EXPORT_TIMEOUT_S,
            "retry": env.EXPORT_RETRY.read(default=EXPORT_TIMEOUT_S + 60),
        },
    },
}
# --- Fairshare ------------------------------------------------------------------------------
# Each app declares its keys, defaults and variables in `<app>/conf.py`: read here from the
# environment, then wired together. Code reads `settings.FAIRSHARE["KEY"]`.
FAIRSHARE = {
    **scheduling_conf.read_settings(
        scheduling_conf.SETTINGS, budgets_conf.SETTINGS, exports_conf.SETTINGS, tasks_conf.SETTINGS,
        usage_conf.SETTINGS, testing.SETTINGS),
    # Outer to inner, like MIDDLEWARE: each entry wraps everything below it.
    "TASK_MIDDLEWARE": [
        "scheduling.middleware.ContractMiddleware",
        "scheduling.middleware.RunRecordingMiddleware",
        # A Django task call's claim and completion in the round trips of its run's admission and
        # settlement (above the budget middleware, which sends them).
        "tasks.execution.CallMiddleware",
        # Admission, CPU cap and settlement; it also holds work a pause covers (its admission reads
        # the pause with the account's standing), so scheduling.pausing.PauseMiddleware, for chains
        # without budgets, is not listed.
        "budgets.middleware.BudgetMiddleware",
        "scheduling.middleware.RetryMiddleware",
    ],
    # The enqueue-time checks account work passes before it is sent to the broker (dotted paths,
    # like AUTHENTICATION_BACKENDS; see scheduling.runtime.EnqueueGate). A gate may hold the job.
    # The pause gate first: paused work takes no budget slot.
    "ENQUEUE_GATES": ["scheduling.pausing.PauseGate", "budgets.gate.BudgetGate"],
}

# Django's Tasks API (`@task` ... `.enqueue(..., account=...)`) on Fairshare: calls are stored in
# tasks.TaskCall and run through the kernel like any job (tasks/backend.py, docs/tasks.md).
TASKS = {
    "default": {
        "BACKEND": "tasks.backend.FairshareBackend",
        "QUEUES": ["default", "exports"],
        "OPTIONS": {"ACCOUNT_KWARG": "account", "SYSTEM_TASKS": []},
    },
}

# JSON lines in production (LOG_FORMAT=json, the default without DEBUG), readable text in the demo.
LOG_FORMAT = env.LOG_FORMAT.read(default="text" if DEBUG else "json")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "text": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {"()": "config.logging.JsonFormatter"},
    },
    # Every handler redacts (scheduling/redaction.py): a library's message or traceback may quote
    # a credential, an e-mail address or a download link. A handler added here needs the filter.
    "filters": {"redact": {"()": "scheduling.redaction.RedactingFilter"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": LOG_FORMAT, "filters": ["redact"]}},
    "root": {"handlers": ["console"], "level": env.LOG_LEVEL.read()},
    "loggers": {
        "django-q": {"level": env.Q_LOG_LEVEL.read()},  # django-q2's one logger (django_q/conf.py)
        # Django's own handlers (DEFAULT_LOGGING) do not redact: its loggers use ours instead. The
        # web log (django.server) would otherwise record every download link it serves.
        "django": {"handlers": [], "level": "INFO", "propagate": True},
        "django.server": {"handlers": [], "level": "INFO", "propagate": True},
        # The Tasks framework logs every task's start and end at INFO; the runner's "task finished"
        # line already records each run (failures, logged at ERROR, still come through).
        "django_tasks": {"level": "WARNING"},
        # pika (the RabbitMQ client) logs every connection and channel it opens or closes at INFO, and a
        # lost connection at ERROR with a traceback: Fairshare logs each loss itself, once, as a warning
        # with its error class, and reconnects (scheduling/amqp.py, scheduling/rabbitmq.py).
        "pika": {"level": "CRITICAL"},
        "django.tasks": {"level": "WARNING"},
    },
}

# Django 6.1 configures e-mail with MAILERS and deprecates EMAIL_BACKEND and EMAIL_FILE_PATH (they
# warn until the 2028 release removes them); Django 5.2 has only those. The same two variables set
# either. EMAIL_FILE_PATH: where django.core.mail.backends.filebased.EmailBackend writes messages
# (one file per connection).
if django.VERSION >= (6, 1):
    MAILERS = {"default": {"BACKEND": env.EMAIL_BACKEND.read(),
                           "OPTIONS": {"file_path": path} if (path := env.EMAIL_FILE_PATH.read()) else {}}}
else:
    EMAIL_BACKEND = env.EMAIL_BACKEND.read()
    EMAIL_FILE_PATH = env.EMAIL_FILE_PATH.read() or None
LOGIN_URL = "admin:login"
