"""Work conservation with real `qcluster` workers: a settling run hands its slot straight to its
account's next held job, and a free worker pulls other accounts' held work, with no broker round
trip (budgets.handoff, scheduling.runtime.execute).

What a user would notice: every job runs exactly once, an account never has more runs at once
than its cap (the recorded run intervals say so), its jobs start in the order they were sent,
the ledger adds up to the recorded runs, and a worker killed between claiming a job and starting
it loses nothing.
"""
import os
import signal
import time

import pytest
from django_q.models import OrmQ

from budgets import clock
from budgets.models import Reservation
from budgets.reclaim import reclaim_expired
from scheduling.models import DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.runtime import enqueue
from tests.budgets.test_processes import (
    ADMITTED, FAST_BEAT, give_budget, ledger_totals, recorded_totals, runs_of, usage, wait,
)
from tests.conftest import pause_at
from tests.factories import AccountFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]


def most_at_once(runs) -> int:
    """The most runs of these that overlapped at any moment (recorded start to recorded end)."""
    edges = sorted([(r.started_at, 1) for r in runs] + [(r.finished_at, -1) for r in runs])
    at_once = peak = 0
    for _, step in edges:  # an end sorts before a start at the same instant: they do not overlap
        at_once += step
        peak = max(peak, at_once)
    return peak


def is_dead(pid: int) -> bool:
    """Gone, or a zombie its parent (the qcluster) has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def drained(*accounts) -> bool:
    return (not DeferredTask.objects.filter(account__in=accounts).exists()
            and not Reservation.objects.filter(account__in=accounts).exists()
            and not TaskRun.objects.filter(account__in=accounts, outcome=Outcome.RUNNING).exists())


def assert_ran_once_within_cap_in_order(account, refs: list[str], *, cap: int) -> None:
    succeeded = list(runs_of(account, outcome=Outcome.SUCCEEDED).values_list("ref", flat=True))
    assert sorted(succeeded) == sorted(refs)  # each exactly once
    admitted = list(runs_of(account, outcome__in=ADMITTED).order_by("started_at", "pk"))
    assert len(admitted) == len(refs)
    assert most_at_once(admitted) <= cap
    if cap == 1:  # one at a time: they start in the order they were sent
        assert [run.ref for run in admitted] == refs
    assert ledger_totals(account, clock.budget_day()) == recorded_totals(runs_of(account, outcome__in=ADMITTED))
    assert usage(account).cpu_reserved_ms == 0


def test_a_capped_accounts_backlog_runs_through_hand_offs_one_at_a_time_in_order(account, start_cluster):
    give_budget(account, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")
    refs = [f"20/{i}" for i in range(40)]
    for ref in refs:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)

    wait(lambda: runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs) and drained(account),
         timeout=90, what="the backlog to run", clusters=[cluster])
    assert_ran_once_within_cap_in_order(account, refs, cap=1)


def test_a_run_admitted_ahead_outlives_its_claims_lease(account, start_cluster):
    """A job admitted ahead starts on its claim's lease (its start writes nothing to its slot): its
    run, longer than that lease, keeps its slot, because its watcher renews the lease before it
    could end. With the reclaim looking all along, nothing is reclaimed and each runs once."""
    give_budget(account, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="1", FAIRSHARE_HANDOFF_CLAIM_LEASE_S="2")
    refs = [f"3000/{i}" for i in range(3)]  # 3 s each; the second and third are handed their slot
    for ref in refs:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)

    reclaimed = []

    def done():
        reclaimed.append(reclaim_expired())
        return runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs) and drained(account)
    wait(done, timeout=60, interval=0.5, what="the runs to finish", clusters=[cluster])
    assert sum(reclaimed) == 0
    assert_ran_once_within_cap_in_order(account, refs, cap=1)
    assert runs_of(account, outcome=Outcome.LOST).count() == 0


def test_free_workers_pull_other_accounts_held_work_without_exceeding_any_cap(start_cluster):
    wide, narrow, single = AccountFactory(slug="wide"), AccountFactory(slug="narrow"), AccountFactory(slug="single")
    give_budget(wide, cpu_seconds=1000, max_concurrent=3)
    give_budget(narrow, cpu_seconds=1000, max_concurrent=2)
    give_budget(single, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="3")
    sent = {}
    for i in range(25):  # interleaved floods: most of each waits in the holding area
        for account in (wide, narrow, single):
            ref = f"{10 + 7 * (i % 3)}/{account.slug}-{i}"
            sent.setdefault(account, []).append(ref)
            enqueue(job="tests.sleep", account=account.pk, ref=ref)

    wait(lambda: TaskRun.objects.filter(outcome=Outcome.SUCCEEDED).count() >= 75 and drained(wide, narrow, single),
         timeout=120, what="all three backlogs to run", clusters=[cluster])
    for account, cap in ((wide, 3), (narrow, 2), (single, 1)):
        assert_ran_once_within_cap_in_order(account, sent[account], cap=cap)


def kill_a_claimant(account, start_cluster, tmp_path, *, fault: str,
                    rate: tuple[int, int] | None = None) -> tuple[object, list[str], DeferredTask]:
    """A cap-1 backlog of 8 jobs (with `rate`, a rate limit of so many starts per so many seconds)
    in a cluster whose worker stops at `fault` (once), holding a claimed job, and is SIGKILLed
    there; returns the cluster, the refs, and the job its dead worker claimed. Its pool's sentinel
    gives the claim and the slot taken for it back at once (scheduling.deaths), well before their
    lease (30 s) expires."""
    budget = give_budget(account, cpu_seconds=1000, max_concurrent=1)
    if rate is not None:
        budget.rate_starts, budget.rate_period_s = rate
        budget.save()
    pause = pause_at(fault, tmp_path)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", **pause.env)
    refs = [f"20/{i}" for i in range(8)]
    for ref in refs:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)
    wait(pause.reached, timeout=30, what="a worker to stand at the fault point", clusters=[cluster])
    claimed = wait(lambda: DeferredTask.objects.filter(account=account).exclude(claimed_by="").first(),
                   timeout=10, what="the claimed job in the holding area", clusters=[cluster])
    claimant = int(claimed.claimed_by.rsplit(":", 1)[1])
    os.kill(claimant, signal.SIGKILL)
    wait(lambda: is_dead(claimant), timeout=10, what="the claimant to be dead", clusters=[cluster])
    wait(lambda: not DeferredTask.objects.filter(claimed_by=claimed.claimed_by).exists(), timeout=10,
         what="the dead claimant's claim to be given back", clusters=[cluster])
    return cluster, refs, claimed


def assert_recovers_once_in_order(account, refs: list[str], cluster, *, cap: int = 1) -> None:
    def recovered():
        reclaim_expired()  # the reclaim schedule's work: the dead claim's slot comes back
        return runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs) and drained(account)
    wait(recovered, timeout=90, interval=0.5, what="the claimed job and the rest to run", clusters=[cluster])
    assert_ran_once_within_cap_in_order(account, refs, cap=cap)
    assert usage(account).runs == len(refs)


def flood_while_busy(account, n: int) -> dict[str, int]:
    """Enqueue `n` jobs of 100 ms for an account that could run 50 at once, one every 10 ms, into
    a cluster of two workers: after the first few, every worker is busy. Returns the most messages
    the broker held and the most jobs that waited in line for a worker, seen after each enqueue."""
    most = {"in_broker": 0, "waiting_for_a_worker": 0}
    for i in range(n):
        enqueue(job="tests.sleep", account=account.pk, ref=f"100/{i}")
        most["in_broker"] = max(most["in_broker"], OrmQ.objects.count())
        most["waiting_for_a_worker"] = max(most["waiting_for_a_worker"], DeferredTask.objects.filter(
            account=account, reason__in=(DeferReason.WORKERS_BUSY, DeferReason.QUEUED_BEHIND)).count())
        time.sleep(0.01)
    return most


def test_a_flood_while_every_worker_is_busy_waits_in_line_not_in_the_broker(account, start_cluster):
    """The account has 50 slots free, but two workers: once a job sent to the broker waited for
    one, the rest waits in the account's line and the busy workers' loops run it there (pull,
    hand-off, pass-on), instead of the broker holding the flood first in, first out."""
    give_budget(account, cpu_seconds=1000, max_concurrent=50)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2")
    refs = [f"100/{i}" for i in range(40)]
    most = flood_while_busy(account, len(refs))

    wait(lambda: runs_of(account, outcome=Outcome.SUCCEEDED).count() >= len(refs) and drained(account),
         timeout=90, what="the flood to run", clusters=[cluster])
    assert_ran_once_within_cap_in_order(account, refs, cap=2)  # two workers
    # 0.25 s of a flood paced at 10 ms reach the broker before one of its messages has waited that
    # long (and a worker takes one every 100 ms); the rest of it waited in line.
    assert most["in_broker"] <= 20 and most["waiting_for_a_worker"] >= 10, most


def test_a_worker_killed_in_a_flood_that_waits_in_line_loses_and_duplicates_nothing(account, start_cluster, tmp_path):
    """As above, and the worker that passes its slot on to the line's next job dies there (holding
    the job's claim and its admission): the claim expires, the reclaim undoes the admission and the
    job runs once, elsewhere."""
    give_budget(account, cpu_seconds=1000, max_concurrent=50)
    marker = tmp_path / "fault-fired"
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_FAULT="after_pass_on",
                            FAIRSHARE_FAULT_MARKER=str(marker), FAIRSHARE_HANDOFF_CLAIM_LEASE_S="2")
    refs = [f"100/{i}" for i in range(30)]
    flood_while_busy(account, len(refs))
    wait(marker.exists, timeout=30, what="the fault point to fire", clusters=[cluster])

    assert_recovers_once_in_order(account, refs, cluster, cap=2)
    assert runs_of(account, outcome=Outcome.SKIPPED).count() == 1  # the pass-on's run, undone


def test_a_worker_killed_after_claiming_a_held_job_loses_and_duplicates_nothing(account, start_cluster, tmp_path):
    # The first run settles and hands its slot to the second job; the worker dies before running it.
    cluster, refs, claimed = kill_a_claimant(account, start_cluster, tmp_path, fault="before_handoff")
    assert claimed.ref == refs[1]
    assert_recovers_once_in_order(account, refs, cluster)


def test_a_worker_killed_after_passing_its_slot_on_loses_and_duplicates_nothing(account, start_cluster, tmp_path):
    """The pass-on (a run from the holding area hands its slot on in its settlement's statement,
    without the lock) commits the next job's claim, slot and run; the worker dies before running
    it. Its sentinel gives its claim and slot back: the admission is undone and the job released."""
    # The first run came through the broker and hands off under the lock; the second, from the
    # holding area, passes its slot on to the third job, and its worker dies there.
    cluster, refs, claimed = kill_a_claimant(account, start_cluster, tmp_path, fault="after_pass_on")
    assert claimed.ref == refs[2]
    # Admitted by the pass-on (its run recorded for the claimant), undone when its claim went back.
    undone = TaskRun.objects.get(account=account, ref=refs[2], worker=claimed.claimed_by)
    assert undone.outcome == Outcome.SKIPPED
    assert_recovers_once_in_order(account, refs, cluster)


def test_a_worker_killed_mid_run_while_its_slot_carries_charges_is_charged_them_once(account, start_cluster):
    """A chain of pass-ons carries its runs' charges on the slot (budgets.ledger, carried charges);
    its worker is SIGKILLed in the middle of the run the slot came to. The reclaim charges the dead
    run what it reported and the runs it carried, once: the ledger adds up to the recorded runs,
    nothing stays reserved, and the jobs behind it run."""
    give_budget(account, cpu_seconds=1000, max_concurrent=1)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="2", FAIRSHARE_RESERVATION_LEASE="3",
                            FAIRSHARE_TASK_TIMEOUT="30", FAIRSHARE_CHARGE_CARRY="30", **FAST_BEAT)
    before, after = [f"20/{i}" for i in range(4)], [f"20/after-{i}" for i in range(2)]
    for ref in before:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)
    enqueue(job="tests.spin_checked", account=account.pk, ref="3000/carrier")
    for ref in after:
        enqueue(job="tests.sleep", account=account.pk, ref=ref)

    wait(lambda: Reservation.objects.filter(account=account, ref="3000/carrier", carried_runs__gt=0,
                                            cpu_reported_ms__gte=300).exists(),
         timeout=30, what="the long job to run on a slot that carries charges", clusters=[cluster])
    victim = runs_of(account, ref="3000/carrier", outcome=Outcome.RUNNING).get()
    os.kill(int(victim.worker.rsplit(":", 1)[1]), signal.SIGKILL)

    def recovered():
        reclaim_expired()
        return (runs_of(account, pk=victim.pk, outcome=Outcome.LOST).exists()
                and runs_of(account, ref__in=after, outcome=Outcome.SUCCEEDED).count() == len(after))
    wait(recovered, timeout=40, interval=0.5, what="the dead run to be reclaimed and the rest to run",
         clusters=[cluster])

    assert sorted(runs_of(account, outcome=Outcome.SUCCEEDED).values_list("ref", flat=True)) == sorted(before + after)
    assert ledger_totals(account, clock.budget_day()) == recorded_totals(
        runs_of(account, outcome__in=(*ADMITTED, Outcome.LOST)))
    assert usage(account).cpu_reserved_ms == 0
