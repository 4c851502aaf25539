"""Queue messages signed with another key (scheduling/signatures.py): a fallback key's message is
delivered, an unknown key's is recorded with its reason and its work sent again, never dropped
silently; an unverified message is read without running anything it names. (A real worker doing
both: tests/exports/test_key_rotation.py.)"""
from pathlib import Path

import pytest
from django.core import signing
from django.test import Client
from django_q.conf import Conf
from django_q.models import OrmQ
from django_q.signing import PickleSerializer, SignedPackage

from scheduling.broker import RUNNER, send
from scheduling.models import Outcome, TaskRun
from scheduling.signatures import VerifiedFifoORM, read_unverified
from tests.factories import UserFactory
from tests.scheduling.test_ops_endpoints import by, scrape

pytestmark = pytest.mark.django_db

OLD_KEY = "the-key-before-the-rotation"
UNKNOWN_KEY = "a-key-no-worker-has"


def sent_with(key: str, monkeypatch, **envelope) -> None:
    """Send as a producer whose SECRET_KEY is `key` does (django-q2 signs with Conf.SECRET_KEY)."""
    with monkeypatch.context() as m:
        m.setattr(Conf, "SECRET_KEY", key)
        send(**envelope)


def delivered(broker) -> list[dict]:
    """What the broker hands django-q2's pusher, read as the pusher reads it (SECRET_KEY only)."""
    return [SignedPackage.loads(payload) for _, payload in broker.dequeue() or []]


def test_a_message_signed_with_the_current_key_is_delivered_as_it_is(account):
    send(job="tests.noop", account=account.pk, ref="now")
    stored = OrmQ.objects.get().payload
    [(_, payload)] = VerifiedFifoORM("default").dequeue()
    assert payload == stored


def test_a_message_signed_with_a_fallback_key_is_delivered(account, settings, monkeypatch):
    settings.SECRET_KEY_FALLBACKS = ["some-older-key", OLD_KEY]
    sent_with(OLD_KEY, monkeypatch, job="tests.noop", account=account.pk, ref="rotated")
    [task] = delivered(VerifiedFifoORM("default"))
    assert task["func"] == RUNNER
    assert task["args"][0] == {"v": 2, "job": "tests.noop", "account": account.pk, "ref": "rotated", "priority": 0}
    assert not TaskRun.objects.exists()  # nothing to record


def test_a_message_no_key_verifies_is_recorded_with_its_reason_and_its_work_sent_again(account, settings,
                                                                                         monkeypatch):
    settings.SECRET_KEY_FALLBACKS = [OLD_KEY]
    sent_with(UNKNOWN_KEY, monkeypatch, job="tests.noop", account=account.pk, ref="foreign", priority=7)
    broker = VerifiedFifoORM("default")

    assert delivered(broker) == []  # django-q2's pusher never sees it (it would log and drop it)
    run = TaskRun.objects.get()
    assert (run.job, run.account, run.ref, run.outcome) == ("tests.noop", account, "foreign", Outcome.REJECTED)
    assert run.error_class == "scheduling.signatures.UnverifiedMessage"
    assert "neither SECRET_KEY nor any of its 1 SECRET_KEY_FALLBACKS verifies it, signed at " in run.error_message
    assert run.error_message.endswith("its work was sent again at once, signed with SECRET_KEY")
    # Sent again, signed with this worker's key: the next dequeue delivers the same work.
    [task] = delivered(broker)
    assert task["args"][0] == {"v": 2, "job": "tests.noop", "account": account.pk, "ref": "foreign", "priority": 7}
    assert task["group"] == f"account-{account.pk}"
    assert OrmQ.objects.count() == 1  # the unverified message is gone, the new one waits for its ack

    samples = scrape()
    failures = by(samples["fairshare_task_failures_total"], "job", "outcome")
    assert failures[("tests.noop", "rejected")] == 1
    # An operator finds it among the task runs, with its reason.
    client = Client()
    client.force_login(UserFactory(username="root", is_staff=True, is_superuser=True))
    listed = client.get("/admin/scheduling/taskrun/?outcome=rejected")
    assert listed.status_code == 200 and f"/admin/scheduling/taskrun/{run.pk}/change/" in listed.content.decode()
    page = client.get(f"/admin/scheduling/taskrun/{run.pk}/change/").content.decode()
    assert "scheduling.signatures.UnverifiedMessage" in page
    assert "its work was sent again at once, signed with SECRET_KEY" in page


class WritesAFile:
    """What a forged pickle would run when loaded: it writes `path`."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return Path.write_text, (Path(self.path), "ran")


def forged(task: dict) -> None:
    payload = signing.dumps(task, key=UNKNOWN_KEY, salt=Conf.PREFIX, compress=True, serializer=PickleSerializer)
    VerifiedFifoORM("default").enqueue(payload)


def test_an_unverified_message_is_read_without_running_what_it_names_and_is_not_sent_on(tmp_path):
    marker = tmp_path / "ran"
    forged({"id": "x", "name": "x", "func": RUNNER, "args": (WritesAFile(str(marker)),), "kwargs": {}})
    forged({"id": "y", "name": "y", "func": "os.system", "args": ("true",), "kwargs": {}})
    VerifiedFifoORM("default").enqueue("not a signed message at all")

    broker = VerifiedFifoORM("default")
    assert [delivered(broker) for _ in range(3)] == [[], [], []]  # one a time (Q_CLUSTER["bulk"])
    assert not marker.exists()
    assert not OrmQ.objects.exists()  # all three taken out of the queue; none of them sent on
    runs = TaskRun.objects.all()
    assert [r.job for r in runs] == ["(malformed)"] * 3
    assert all(r.error_message.endswith("not a Fairshare message (or unreadable): taken out of the queue, not sent "
                                        "again") for r in runs)


def test_an_unverified_pickle_is_read_as_plain_data(tmp_path):
    marker = tmp_path / "ran"
    payload = signing.dumps({"func": RUNNER, "args": (WritesAFile(str(marker)),)}, key=UNKNOWN_KEY,
                            salt=Conf.PREFIX, serializer=PickleSerializer)
    task, signed_at = read_unverified(payload)
    assert task["func"] == RUNNER and signed_at is not None
    assert not marker.exists()
