"""A flood sent with `enqueue_many` for an account whose cap is above the number of workers: the
broker gets no more than the queue's idle workers could start now (its running workers, by their
heartbeats, less the slots taken: budgets.ledger.idle_workers); the rest waits in line, where the
busy workers' loops take it in the fair order (weights, then priorities), instead of in the
broker's first in, first out. In-process, and with real workers (every job runs exactly once)."""
import pytest
from django_q.models import OrmQ

from budgets.admission import admit
from budgets.handoff import fetch_next
from budgets.models import Budget
from scheduling.envelope import Envelope
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun, WorkerHeartbeat
from scheduling.runtime import enqueue, enqueue_many
from tests.budgets.test_admission import queued_envelopes
from tests.budgets.test_handoff import assert_ran_once_within_cap_in_order, drained
from tests.budgets.test_processes import give_budget, runs_of, wait


def line(account) -> list[tuple[str, str]]:
    return list(DeferredTask.objects.filter(account=account, in_line_since__isnull=False)
                .order_by("-priority", "in_line_since", "id").values_list("ref", "reason"))


def start(account, ref: str) -> bool:
    return admit(envelope=Envelope(job="tests.noop", account=account.pk, ref=ref), queue="default",
                 estimate_ms=10, worker="w").admitted


@pytest.mark.django_db
def test_a_flood_sends_only_what_the_idle_workers_can_start_and_the_rest_goes_in_fair_order(
        account, other_account, beating_workers):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=50)
    Budget.objects.create(account=other_account, queue="default", cpu_seconds_per_day=100, max_concurrent=50)
    beating_workers(3)
    assert enqueue(job="tests.noop", account=other_account.pk, ref="x") is not None  # one worker's now

    sent = enqueue_many(job="tests.noop", work=[(account.pk, f"f{i}") for i in range(20)])
    # Its cap (50) would let all 20 go; the two workers left idle can start two.
    assert sum(task_id is not None for task_id in sent) == 2
    assert [e["ref"] for e in queued_envelopes()] == ["x", "f0", "f1"]
    assert line(account) == [("f2", DeferReason.WORKERS_BUSY)] + [(f"f{i}", DeferReason.QUEUED_BEHIND)
                                                                  for i in range(3, 20)]
    # Every worker has a job: the next work waits in line too, the single enqueue's as the batch's.
    assert enqueue_many(job="tests.noop", work=[(other_account.pk, "y")]) == [None]
    assert enqueue(job="tests.noop", account=other_account.pk, ref="z") is None
    assert enqueue_many(job="tests.noop", work=[(account.pk, "urgent")], priority=50) == [None]
    assert OrmQ.objects.count() == 3

    # Once the broker's jobs started, the workers' loops take the lines' work in the fair order:
    # the account with fewer slots in use first, and in an account's line its highest priority first.
    assert start(other_account, "x") and start(account, "f0") and start(account, "f1")
    assert fetch_next(queue="default", worker="w1").envelope.ref == "y"
    assert fetch_next(queue="default", worker="w2").envelope.ref == "z"  # 2 slots each: the line waiting longest
    assert fetch_next(queue="default", worker="w3").envelope.ref == "urgent"  # ahead of the older "f2"
    assert fetch_next(queue="default", worker="w4").envelope.ref == "f2"


@pytest.mark.django_db
def test_without_running_workers_a_flood_waits_in_line_for_them(account, beating_workers):
    Budget.objects.create(account=account, queue="default", cpu_seconds_per_day=100, max_concurrent=50)
    beating_workers(0)
    assert enqueue_many(job="tests.noop", work=[(account.pk, f"f{i}") for i in range(5)]) == [None] * 5
    assert not OrmQ.objects.exists()
    assert line(account)[0] == ("f0", DeferReason.WORKERS_BUSY)


@pytest.mark.django_db(transaction=True)
@pytest.mark.processes
def test_a_flood_through_the_idle_workers_runs_every_job_exactly_once(account, start_cluster):
    give_budget(account, cpu_seconds=1000, max_concurrent=20)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")
    wait(lambda: WorkerHeartbeat.objects.filter(queue="default").count() >= 2, timeout=60,
         what="both workers' heartbeats", clusters=[cluster])
    refs = [f"10/{i}" for i in range(60)]
    sent = enqueue_many(job="tests.sleep", work=[(account.pk, ref) for ref in refs])
    assert sum(task_id is not None for task_id in sent) <= 2  # the broker got no more than the workers

    wait(lambda: runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs) and drained(account),
         timeout=120, what="the flood to run", clusters=[cluster])
    assert_ran_once_within_cap_in_order(account, refs, cap=20)
    assert not TaskRun.objects.filter(account=account).exclude(outcome=Outcome.SUCCEEDED).exists()
