"""Planted secrets (issue 11): every kind of secret a failure may quote - a DSN password, AWS key
ids, an `fs_` API token, a bearer token, a key-named secret, a card number, an e-mail address - is
raised and logged inside real jobs run by real `qcluster` processes, one of them hitting the task
time limit while it handles an exception quoting them all, and an export whose storage refuses a
bad AWS key id. None reaches any table (the whole database, dumped), an admin page, an API answer,
`export_status` or a log line; each redacted message still says what went wrong."""
import io
import uuid

import pytest
from django.apps import apps
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django_q.models import Failure

from exports.models import ExportRecord, ExportStatus
from exports.requests import export_request
from scheduling.models import Outcome, TaskRun
from scheduling.runtime import enqueue
from tests.conftest import wait_for
from tests.exports.support import RANGE, add_events, bearer
from tests.factories import UserFactory
from tests.jobs import MEANING, PLANTED, SECRETS

pytestmark = [pytest.mark.processes, pytest.mark.django_db(transaction=True)]

TIME_LIMIT_S = 2


def _database_dump() -> str:
    """Every row of every table: through the ORM (pickled fields decoded) and as raw SQL text."""
    parts = [repr(list(model._default_manager.values())) for model in apps.get_models()]
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT * FROM "{table}"')  # noqa: S608 - names from the introspection
            parts.append(repr(cursor.fetchall()))
    return "\n".join(parts)


def _admin_pages(export: ExportRecord) -> str:
    client = Client()
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    urls = ["/admin/scheduling/taskrun/", "/admin/exports/exportrecord/", "/admin/django_q/failure/",
            f"/admin/exports/exportrecord/{export.pk}/change/"]
    urls += [f"/admin/scheduling/taskrun/{pk}/change/" for pk in TaskRun.objects.values_list("pk", flat=True)]
    urls += [f"/admin/django_q/failure/{pk}/change/" for pk in Failure.objects.values_list("pk", flat=True)]
    pages = []
    for url in urls:
        response = client.get(url)
        assert response.status_code == 200, url
        pages.append(response.content.decode())
    return "\n".join(pages)


def _api_and_command(export: ExportRecord, owner) -> str:
    answer = Client().get(f"/api/exports/{export.pk}/", **bearer(owner))
    assert answer.status_code == 200
    out = io.StringIO()
    call_command("export_status", str(export.pk), "--json", stdout=out)
    call_command("export_status", str(export.pk), stdout=out)
    return answer.content.decode() + out.getvalue()


def test_no_planted_secret_is_stored_shown_or_logged(account, owner, start_cluster, start_exports):
    add_events(account, 20)
    default = start_cluster("default", FAIRSHARE_TASK_TIMEOUT=str(TIME_LIMIT_S))
    exports = start_exports(FAIRSHARE_EXPORTS_STORAGE_BACKEND="tests.storages.LeakyS3Storage")
    refs = {kind: f"{kind}/{uuid.uuid4()}" for kind in SECRETS}
    for ref in refs.values():
        enqueue(job="tests.leak", account=account.pk, ref=ref)
    timeout_ref = f"{30 * 1000}/{uuid.uuid4()}"  # sleeps 30 s: the 2 s time limit stops it
    enqueue(job="tests.leak_timeout", account=account.pk, ref=timeout_ref)
    export, _ = export_request(account_slug="acme", user=owner, **RANGE)

    def logs() -> str:
        return f"default:\n{default.log()[-3000:]}\nexports:\n{exports.log()[-3000:]}"

    wait_for(lambda: TaskRun.objects.filter(ref__in=[*refs.values(), timeout_ref]).exclude(
        outcome=Outcome.RUNNING).count() == len(refs) + 1, timeout=90, message=f"the planted jobs; {logs()}")
    wait_for(lambda: ExportRecord.objects.get(pk=export.pk).is_finished, timeout=90, message=f"the export; {logs()}")
    # (Unacknowledged, as django-q2 leaves failures: its broker would deliver it again after `retry`.)
    wait_for(Failure.objects.exists, timeout=60, message=f"django-q2 to record the timed-out task; {logs()}")
    default.stop()
    exports.stop()

    # Each failure is recorded, redacted, and still says what went wrong.
    for kind, ref in refs.items():
        run = TaskRun.objects.get(ref=ref)
        assert (run.outcome, run.error_class) == (Outcome.FAILED, "RuntimeError"), kind
        assert MEANING[kind] in run.error_message, (kind, run.error_message)
    timed_out = TaskRun.objects.get(ref=timeout_ref)
    assert timed_out.outcome == Outcome.FAILED
    assert timed_out.error_class == "django_q.exceptions.TimeoutException"
    assert "timeout" in timed_out.error_message.lower()
    failure = Failure.objects.get()
    assert "time limit" in str(failure.result) and "During handling" not in str(failure.result)
    export.refresh_from_db()
    assert export.status == ExportStatus.FAILED
    assert "InvalidAccessKeyId" in export.error_message and "AKIA***" in export.error_message

    seen = {
        "database": _database_dump(),
        "admin": _admin_pages(export),
        "api and export_status": _api_and_command(export, owner),
        "cluster logs": default.log() + exports.log(),
    }
    assert "calling upstream failed" in seen["cluster logs"]  # the jobs did log their (redacted) lines
    for where, text in seen.items():
        leaked = [secret for secret in PLANTED if secret in text]
        assert not leaked, f"{leaked} found in the {where}"
