"""The environment variables config/settings.py reads for itself: Django, the database, export
storage, the task queues, logging and e-mail. (Each app's FAIRSHARE keys are declared in its
`conf.py`, the test-only seams in scheduling/testing.py.) README.md's configuration table is
generated from these declarations and those (`python -m config.readme`).

No side effects and no django.conf: importable before Django is set up.
"""
from scheduling.conf import Setting, flag, names

VAR_DIR = Setting(None, "FAIRSHARE_VAR_DIR", None, shown_default="`var/`", sets="the demo's files",
                  doc="folder of everything the demo writes (its embedded PostgreSQL's data, export files, logs, "
                      "`demo.env` while it runs)")
DEBUG = Setting(None, "DEBUG", False, parse=flag, sets="`DEBUG`", doc="Django's debug mode")
SECRET_KEY = Setting(None, "SECRET_KEY", "", shown_default="none (required unless `DEBUG=1`)",
                     sets="`SECRET_KEY`", doc="Django's secret key; also signs download links")
SECRET_KEY_FALLBACKS = Setting(
    None, "SECRET_KEY_FALLBACKS", [], parse=names, shown_default="none", sets="`SECRET_KEY_FALLBACKS`",
    doc="comma-separated previous secret keys, during a key rotation: download links and queue messages "
        "signed with one of them are still accepted (a queue message signed with no known key is recorded as a "
        "rejected task run and its work sent again)")
ALLOWED_HOSTS = Setting(None, "ALLOWED_HOSTS", ["127.0.0.1", "localhost"], parse=names, sets="`ALLOWED_HOSTS`",
                        doc="comma-separated host names the web server answers to")
DATABASE_URL = Setting(None, "DATABASE_URL", "",
                       shown_default="none (required; beside a running demo, its embedded server's, from "
                                     "`var/demo.env`)",
                       sets="`DATABASES`", doc="the PostgreSQL database (`postgres://USER[:PASSWORD]@HOST:PORT/NAME`); "
                                             "any other database is refused at start-up")
DB_CONN_MAX_AGE = Setting(None, "FAIRSHARE_DB_CONN_MAX_AGE", 60, parse=int, unit="s", sets="`CONN_MAX_AGE`",
                          doc="how long a database connection is reused (checked before reuse); 0 "
                              "reconnects for every task")
# How long one PostgreSQL session may hold what it holds (docs/architecture.md, "A frozen process").
# A worker frozen inside a transaction (SIGSTOP, a VM pause) keeps its row locks until its session
# ends: the server ends a session idle in a transaction after the first timeout, which rolls it back
# and frees its locks. A waiter gives up after the second (an error its task retries), longer, so a
# frozen holder only ever delays the others. 0 leaves the server's or the role's own value.
DB_IDLE_IN_TRANSACTION_TIMEOUT = Setting(
    None, "FAIRSHARE_DB_IDLE_IN_TRANSACTION_TIMEOUT_S", 60, parse=int, unit="s",
    sets="PostgreSQL `idle_in_transaction_session_timeout`",
    doc="the server ends a session of Fairshare's that sat this long inside a transaction without a statement "
        "(a frozen or hung process), rolling it back and releasing its row locks; Fairshare's own transactions "
        "wait milliseconds between statements")
DB_LOCK_TIMEOUT = Setting(
    None, "FAIRSHARE_DB_LOCK_TIMEOUT_S", 120, parse=int, unit="s", sets="PostgreSQL `lock_timeout`",
    doc="a statement waiting this long for a lock fails (its task is retried): held by a working session, or "
        "one without the timeout above (a migration, a person's `psql`); above that timeout, so that a frozen "
        "holder's session ends first and a freeze only delays")
DB_STATEMENT_TIMEOUT = Setting(
    None, "FAIRSHARE_DB_STATEMENT_TIMEOUT_S", 0, parse=int, unit="s", shown_default="0 (off)",
    sets="PostgreSQL `statement_timeout`",
    doc="a statement running this long is cancelled; off by default: it bounds slow queries, not frozen "
        "processes, and an export's `COPY` or a migration may rightly run for minutes; when set, above "
        "`FAIRSHARE_DB_LOCK_TIMEOUT_S`")
REDIS_URL = Setting(None, "REDIS_URL", "", shown_default="unset: django-q2's ORM broker",
                    sets='`Q_CLUSTER["redis"]`', doc="use the Redis broker")
RABBITMQ_URL = Setting(None, "RABBITMQ_URL", "", shown_default="unset",
                       sets='`RABBITMQ_URL`, `Q_CLUSTER["broker_class"]`',
                       doc="use the RabbitMQ broker (`amqp://user:password@host:5672/vhost`; not with `REDIS_URL`)")
TASK_TIMEOUT = Setting(None, "FAIRSHARE_TASK_TIMEOUT", 300, parse=int, unit="s",
                       sets='`Q_CLUSTER["timeout"]`',
                       doc="time limit of a task on the default queue (its `retry` is set 60 s above)")
WORKERS = Setting(None, "FAIRSHARE_WORKERS", 2, parse=int, sets='`Q_CLUSTER["workers"]`',
                  doc="worker processes of the default queue")
POLL = Setting(None, "FAIRSHARE_POLL", 0.1, parse=float, unit="s", sets='`Q_CLUSTER["poll"]`',
               doc="how often an idle ORM-broker cluster looks for new tasks (one query per poll per cluster; "
                   "a job sent into a free slot waits up to this long)")
EXPORT_TIMEOUT = Setting(None, "FAIRSHARE_EXPORT_TIMEOUT", 1800, parse=int, unit="s",
                         sets='exports cluster `timeout`', doc="time limit of a task on the exports queue")
EXPORT_RETRY = Setting(None, "FAIRSHARE_EXPORT_RETRY", None, parse=int, unit="s",
                       shown_default="`FAIRSHARE_EXPORT_TIMEOUT` + 60 s", sets="exports cluster `retry`",
                       doc="seconds before the broker delivers an unacknowledged export task again; "
                           "must exceed the timeout")
EXPORT_WORKERS = Setting(None, "FAIRSHARE_EXPORT_WORKERS", 2, parse=int, sets="exports cluster `workers`",
                         doc="worker processes of the exports queue")
EXPORTS_S3_BUCKET = Setting(None, "FAIRSHARE_EXPORTS_S3_BUCKET", "", shown_default="unset",
                            sets='`STORAGES["exports"]`',
                            doc="store exports in this S3 bucket through django-storages (credentials the "
                                "usual AWS way)")
EXPORTS_S3_ENDPOINT_URL = Setting(None, "FAIRSHARE_EXPORTS_S3_ENDPOINT_URL", "", shown_default="unset",
                                  sets='`STORAGES["exports"]`', doc="S3 endpoint (S3-compatible stores)")
EXPORTS_S3_REGION = Setting(None, "FAIRSHARE_EXPORTS_S3_REGION", "", shown_default="unset",
                            sets='`STORAGES["exports"]`', doc="S3 region")
EXPORTS_STORAGE_BACKEND = Setting(
    None, "FAIRSHARE_EXPORTS_STORAGE_BACKEND", "django.core.files.storage.FileSystemStorage",
    sets='`STORAGES["exports"]`',
    doc="storage class for local export files (any `FileSystemStorage` subclass; ignored with S3)")
EXPORTS_ROOT = Setting(None, "FAIRSHARE_EXPORTS_ROOT", None, shown_default="`var/exports`",
                       sets='`STORAGES["exports"]`', doc="folder of export files (local storage)")
LOG_FORMAT = Setting(None, "LOG_FORMAT", None, shown_default="`json` (`text` with `DEBUG`)", sets="`LOGGING`",
                     doc="`json`: one JSON object per log line (production); `text`: readable lines")
LOG_LEVEL = Setting(None, "LOG_LEVEL", "INFO", sets="`LOGGING`", doc="level of the root logger")
Q_LOG_LEVEL = Setting(None, "Q_LOG_LEVEL", "INFO", sets="`LOGGING`", doc="level of django-q2's own logger")
EMAIL_BACKEND = Setting(None, "EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend",
                        shown_default="console backend", sets="`MAILERS` (Django 6.1), `EMAIL_BACKEND` (5.2)",
                        doc="Django's e-mail backend for \"export ready\" notices")
EMAIL_FILE_PATH = Setting(None, "EMAIL_FILE_PATH", None, shown_default="unset",
                          sets="`MAILERS` (Django 6.1), `EMAIL_FILE_PATH` (5.2)",
                          doc="the folder of the file-based e-mail backend")

# HTTPS: on by default without DEBUG, so that a production deployment is secure unless someone turns
# a part off on purpose (`manage.py check --deploy` is clean with DEBUG unset and a strong SECRET_KEY;
# tests/test_settings.py). DEBUG (the demo) leaves them off, and so does the test suite, which says so
# in tests/conftest.py: both speak plain HTTP on loopback. Each variable turns its part off (`0`) or
# on (`1`) whatever DEBUG says. The default is given at read time: config/settings.py passes `not DEBUG`.
SECURE_BY_DEFAULT = "on without `DEBUG`, off with it"
SSL_REDIRECT = Setting(None, "SECURE_SSL_REDIRECT", False, parse=flag, shown_default=SECURE_BY_DEFAULT,
                       sets="`SECURE_SSL_REDIRECT`", doc="redirect every plain-HTTP request to HTTPS")
HSTS_SECONDS = Setting(None, "SECURE_HSTS_SECONDS", 0, parse=int, unit="s",
                       shown_default="31,536,000 s (a year) without `DEBUG`, 0 with it", sets="`SECURE_HSTS_SECONDS`",
                       doc="Strict-Transport-Security max-age (0: no header)")
HSTS_INCLUDE_SUBDOMAINS = Setting(None, "SECURE_HSTS_INCLUDE_SUBDOMAINS", False, parse=flag,
                                  shown_default=SECURE_BY_DEFAULT, sets="`SECURE_HSTS_INCLUDE_SUBDOMAINS`",
                                  doc="HSTS covers the subdomains of the host that serves Fairshare too; turn off "
                                      "if one of them is not on HTTPS")
HSTS_PRELOAD = Setting(None, "SECURE_HSTS_PRELOAD", False, parse=flag, shown_default=SECURE_BY_DEFAULT,
                       sets="`SECURE_HSTS_PRELOAD`",
                       doc="the HSTS header consents to browsers' preload lists (nothing is listed unless "
                           "someone submits the domain)")
SESSION_COOKIE_SECURE = Setting(None, "SESSION_COOKIE_SECURE", False, parse=flag, shown_default=SECURE_BY_DEFAULT,
                                sets="`SESSION_COOKIE_SECURE`", doc="send the session cookie over HTTPS only")
CSRF_COOKIE_SECURE = Setting(None, "CSRF_COOKIE_SECURE", False, parse=flag, shown_default=SECURE_BY_DEFAULT,
                             sets="`CSRF_COOKIE_SECURE`", doc="send the CSRF cookie over HTTPS only")
HSTS_SECONDS_WITHOUT_DEBUG = 31_536_000  # a year: what `check --deploy` and the preload lists ask for
PROXY_SSL_HEADER = Setting(None, "SECURE_PROXY_SSL_HEADER", "", shown_default="unset",
                           sets="`SECURE_PROXY_SSL_HEADER`",
                           doc="behind a TLS-terminating proxy: the header that says HTTPS, as "
                               "`NAME=value` (e.g. `HTTP_X_FORWARDED_PROTO=https`)")

VARIABLES = (
    VAR_DIR, DEBUG, SECRET_KEY, SECRET_KEY_FALLBACKS, ALLOWED_HOSTS, DATABASE_URL, DB_CONN_MAX_AGE,
    DB_IDLE_IN_TRANSACTION_TIMEOUT, DB_LOCK_TIMEOUT, DB_STATEMENT_TIMEOUT, REDIS_URL, RABBITMQ_URL,
    TASK_TIMEOUT, WORKERS, POLL, EXPORT_TIMEOUT, EXPORT_RETRY, EXPORT_WORKERS,
    EXPORTS_S3_BUCKET, EXPORTS_S3_ENDPOINT_URL, EXPORTS_S3_REGION, EXPORTS_STORAGE_BACKEND, EXPORTS_ROOT,
    LOG_FORMAT, LOG_LEVEL, Q_LOG_LEVEL, EMAIL_BACKEND, EMAIL_FILE_PATH,
    SSL_REDIRECT, HSTS_SECONDS, HSTS_INCLUDE_SUBDOMAINS, HSTS_PRELOAD, SESSION_COOKIE_SECURE, CSRF_COOKIE_SECURE,
    PROXY_SSL_HEADER,
)
