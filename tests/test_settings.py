"""Settings: declared once per app, documented in README.md as declared, test-only seams refused
outside the test suite."""
import os
import re
import subprocess
import sys

import django
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from budgets import conf as budgets_conf
from config import env, readme
from exports import conf as exports_conf
from scheduling import conf as scheduling_conf
from scheduling import testing
from tasks import conf as tasks_conf
from usage import conf as usage_conf
from tests.conftest import REPO, worker_env

DECLARED = (*env.VARIABLES, *scheduling_conf.SETTINGS, *budgets_conf.SETTINGS, *exports_conf.SETTINGS,
            *tasks_conf.SETTINGS, *usage_conf.SETTINGS, testing.TESTING, *testing.SEAMS)


def test_the_readme_configuration_tables_are_the_declarations():
    text = readme.README.read_text()
    assert readme.render(text) == text, "README.md is out of date: run `python -m config.readme --write`"


def test_every_fairshare_key_is_declared_once():
    keys = [s.key for s in DECLARED if s.key]
    assert len(keys) == len(set(keys))
    assert set(settings.FAIRSHARE) == set(keys) | set(readme.WIRED_IN_SETTINGS)


def test_every_variable_is_declared_once_and_settings_read_no_other():
    variables = [s.env for s in DECLARED if s.env]
    assert len(variables) == len(set(variables))
    # Everything config/settings.py reads goes through a declaration, so the README lists it.
    source = (REPO / "config" / "settings.py").read_text()
    assert "os.environ" not in source and "getenv" not in source


def test_a_variable_sets_its_key_and_the_rest_keep_their_defaults():
    values = scheduling_conf.read_settings(exports_conf.SETTINGS, environ={"FAIRSHARE_EXPORT_LEASE": "30"})
    assert values["EXPORT_LEASE_S"] == 30
    assert values["EXPORT_BATCH_ROWS"] == 10_000


def test_a_malformed_number_names_its_variable():
    with pytest.raises(ImproperlyConfigured) as refused:
        scheduling_conf.read_settings(exports_conf.SETTINGS, environ={"FAIRSHARE_EXPORT_LEASE": "soon"})
    assert str(refused.value) == "FAIRSHARE_EXPORT_LEASE must be a whole number (s), got 'soon'."


def test_the_declarations_import_without_django_set_up():
    code = ("import sys; import config.env, config.readme, scheduling.conf, scheduling.testing, budgets.conf, "
            "exports.conf; assert 'django.conf' not in sys.modules, 'django.conf was imported'")
    env_ = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env_, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("seam", testing.SEAMS, ids=lambda seam: seam.env)
def test_a_seam_is_refused_outside_the_test_suite(seam):
    with pytest.raises(ImproperlyConfigured) as refused:
        testing.refuse_seams_unless_testing({seam.env: "1"})
    assert str(refused.value) == (
        f"{seam.env} is test-only (scheduling/testing.py) and refused outside the test suite: unset it, "
        "or export FAIRSHARE_TESTING=1 if this process belongs to a test.")
    testing.refuse_seams_unless_testing({seam.env: "1", "FAIRSHARE_TESTING": "1"})  # allowed
    testing.refuse_seams_unless_testing({seam.env: ""})  # unset in all but name: inert


def test_a_process_with_a_seam_outside_the_test_suite_does_not_start():
    env_ = {k: v for k, v in os.environ.items() if k != "FAIRSHARE_TESTING"}
    env_.update(FAIRSHARE_CLOCK_OFFSET="86400", FAIRSHARE_FAULT="after_claim")

    done = subprocess.run([sys.executable, "manage.py", "check"], cwd=REPO, env=env_, capture_output=True,
                          text=True, timeout=60)

    assert done.returncode == 1
    assert ("ImproperlyConfigured: FAIRSHARE_CLOCK_OFFSET, FAIRSHARE_FAULT are test-only (scheduling/testing.py) "
            "and refused outside the test suite") in done.stderr, done.stderr


def test_workers_started_by_tests_may_use_seams(export_root):
    assert worker_env(export_root)["FAIRSHARE_TESTING"] == "1"


def test_the_readme_names_every_system_check():
    ids = {found for app in ("scheduling", "budgets", "exports")
           for found in re.findall(r'id="([a-z]+\.[EW]\d{3})"', (REPO / app / "checks.py").read_text())}
    assert {"scheduling.E001", "budgets.E001", "exports.E001"} <= ids
    text = readme.README.read_text()
    assert [i for i in sorted(ids) if f"`{i}`" not in text] == []


# --- Secure by default ---------------------------------------------------------------------------

HTTPS_VARIABLES = {env.SSL_REDIRECT.env: "security.W008", env.HSTS_SECONDS.env: "security.W004",
                   env.HSTS_INCLUDE_SUBDOMAINS.env: "security.W005", env.HSTS_PRELOAD.env: "security.W021",
                   env.SESSION_COOKIE_SECURE.env: "security.W012", env.CSRF_COOKIE_SECURE.env: "security.W016"}
STRONG_KEY = "x7Qp2" * 12 + "-production-like-secret"


def production_env(**extra: str) -> dict[str, str]:
    """This environment less DEBUG, the test switch and every HTTPS variable, with a strong key."""
    dropped = {"DEBUG", "FAIRSHARE_TESTING", *HTTPS_VARIABLES}
    return {**{k: v for k, v in os.environ.items() if k not in dropped},
            "SECRET_KEY": STRONG_KEY, "DJANGO_SETTINGS_MODULE": "config.settings", **extra}


def check_deploy(environ: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=REPO, env=environ, capture_output=True, text=True, timeout=120)


def warnings_named(done: subprocess.CompletedProcess) -> set[str]:
    return set(re.findall(r"\((security\.W\d{3})\)", done.stdout + done.stderr))


# A deployment names its mail server (docs/deploy.md); the default, the console backend, sends nothing.
SMTP = {env.EMAIL_BACKEND.env: "django.core.mail.backends.smtp.EmailBackend"}


def test_check_deploy_is_clean_with_only_debug_unset_a_strong_secret_key_and_a_mail_server():
    done = check_deploy(production_env(**SMTP))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


@pytest.mark.skipif(django.VERSION < (6, 1), reason="Django 6.1's MAILERS brought this check")
def test_check_deploy_on_django_6_1_says_the_console_mail_backend_sends_nothing():
    done = check_deploy(production_env())
    assert done.returncode == 1
    assert "(mail.E001) Your MAILERS setting uses a development-only email backend" in done.stderr, done.stderr


def test_each_https_part_can_be_turned_off_and_django_then_names_it():
    done = check_deploy(production_env(**dict.fromkeys(HTTPS_VARIABLES, "0")))
    assert done.returncode == 1
    # W005 and W021 are about the HSTS header, which is off here too; each is named on its own below.
    assert warnings_named(done) == {"security.W004", "security.W008", "security.W012", "security.W016"}
    done = check_deploy(production_env(SECURE_HSTS_INCLUDE_SUBDOMAINS="0", SECURE_HSTS_PRELOAD="0"))
    assert warnings_named(done) == {"security.W005", "security.W021"}


def test_debug_and_the_test_suite_speak_plain_http():
    code = ("from django.conf import settings as s; print(s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, "
            "s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE)")
    done = subprocess.run([sys.executable, "manage.py", "shell", "-c", code], cwd=REPO,
                          env=production_env(DEBUG="1"), capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1].split() == ["False", "0", "False", "False"], done.stdout + done.stderr
    # This process: off because tests/conftest.py says so (the client below is plain HTTP).
    assert (settings.SECURE_SSL_REDIRECT, settings.SESSION_COOKIE_SECURE, settings.CSRF_COOKIE_SECURE) == (
        False, False, False)


@pytest.mark.django_db
def test_probes_are_answered_over_plain_http_when_everything_else_is_redirected(settings, client):
    settings.SECURE_SSL_REDIRECT = True
    assert client.get("/admin/").status_code == 301
    assert client.get("/healthz").status_code in (200, 503)  # its own answer, not a redirect
    assert client.get("/metrics").status_code == 200
