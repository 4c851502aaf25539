"""Tiered fair share with real `qcluster` workers: a rate limit holds across clusters (the recorded
start times say so), weights and priorities decide the order work starts in, and a worker killed
while holding a rate-limited claim loses and duplicates nothing."""
import bisect
import datetime as dt

import pytest

from budgets.models import Budget
from scheduling.models import Outcome
from scheduling.runtime import enqueue, enqueue_many
from tests.budgets.test_handoff import (
    assert_ran_once_within_cap_in_order, assert_recovers_once_in_order, drained, kill_a_claimant,
)
from tests.budgets.test_processes import ADMITTED, give_budget, runs_of, wait
from tests.factories import AccountFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.processes]


def most_in_any_window(times, period_s: float) -> int:
    """The most of these moments that fall in any window of `period_s` seconds (a half-open
    window starting at each moment: the worst one starts at one of them)."""
    times = sorted(times)
    window = dt.timedelta(seconds=period_s)
    return max((bisect.bisect_left(times, t + window) - i for i, t in enumerate(times)), default=0)


def test_a_rate_limit_holds_across_two_clusters_and_their_free_workers_run_other_work(start_cluster):
    limited, other = AccountFactory(slug="limited"), AccountFactory(slug="other")
    budget = give_budget(limited, cpu_seconds=1000, max_concurrent=4)
    budget.rate_starts, budget.rate_period_s = 5, 2
    budget.save()
    give_budget(other, cpu_seconds=1000, max_concurrent=4)
    clusters = [start_cluster("default", FAIRSHARE_WORKERS="2") for _ in range(2)]
    limited_refs = [f"20/limited-{i}" for i in range(20)]
    enqueue_many(job="tests.sleep", work=[(limited.pk, ref) for ref in limited_refs])
    enqueue_many(job="tests.sleep", work=[(other.pk, f"20/other-{i}") for i in range(150)])

    wait(lambda: runs_of(limited, outcome=Outcome.SUCCEEDED).count() >= 20 and drained(limited),
         timeout=90, what="the rate-limited backlog to run", clusters=clusters)
    starts = list(runs_of(limited, outcome__in=ADMITTED).values_list("started_at", flat=True))
    assert most_in_any_window(starts, 2.0) <= 5
    assert_ran_once_within_cap_in_order(limited, limited_refs, cap=4)
    # While the limited account waited for its window, the workers ran the other's backlog.
    assert runs_of(other, outcome=Outcome.SUCCEEDED).count() >= 100
    wait(lambda: drained(other), timeout=60, what="the other backlog to run", clusters=clusters)


def test_weights_share_the_workers_and_priority_orders_an_accounts_work(start_cluster):
    light, heavy = AccountFactory(slug="light"), AccountFactory(slug="heavy")
    for account, weight in ((light, 1), (heavy, 3)):
        budget = give_budget(account, cpu_seconds=1000, max_concurrent=6)
        budget.weight = weight
        budget.save()
    enqueue_many(job="tests.sleep", work=[(light.pk, f"20/light-{i}") for i in range(600)], priority=-10)
    enqueue_many(job="tests.sleep", work=[(heavy.pk, f"20/heavy-{i}") for i in range(1200)])
    for i in range(3):  # urgent work behind the light account's backlog
        enqueue(job="tests.sleep", account=light.pk, ref=f"20/urgent-{i}", priority=50)
    cluster = start_cluster("default", FAIRSHARE_WORKERS="4")

    def started():
        return (runs_of(light, outcome__in=ADMITTED).count(), runs_of(heavy, outcome__in=ADMITTED).count())

    # The start is left out: what enqueue sent straight to the broker, and what settlements send
    # after it while it waits there, runs first in, first out until the broker is drained. The
    # share of the starts from the 300th to the 900th, while both still have work waiting.
    light_0, heavy_0 = wait(lambda: (lambda n: n if sum(n) >= 300 else None)(started()), timeout=90,
                            what="the first 300 starts", clusters=[cluster])
    light_1, heavy_1 = wait(lambda: (lambda n: n if sum(n) >= 900 else None)(started()), timeout=180,
                            what="600 more starts", clusters=[cluster])
    # 1 : 3 is a heavy share of 0.75 when every slot goes by the fair order, equal shares 0.5
    # (what slots kept by their accounts gave: 0.51; a pull that skipped a locked account, the
    # heavy one most often, 0.49-0.66). Over a few seconds the broker's first-in-first-out
    # stretches pull it down (0.66-0.74 alone, 0.69-0.72 beside two busy loops); bench/tiers.py
    # measures it over 60 s. The pull order itself is exact in test_rates_and_weights.py.
    share = (heavy_1 - heavy_0) / ((heavy_1 - heavy_0) + (light_1 - light_0))
    assert 0.55 <= share <= 0.9, (light_0, heavy_0, light_1, heavy_1)
    # The light account's urgent jobs, enqueued behind its 600, started among its first few: only
    # what was on its way to a worker went before them (its first 6, sent at enqueue, and what
    # four busy workers pulled while one of them was released to the broker by an idle worker's
    # pulse and waited for its poll: the broker's work goes first in, first out). In line order
    # they would have come after all 600.
    light_order = list(runs_of(light, outcome__in=ADMITTED).order_by("started_at", "pk").values_list("ref", flat=True))
    urgent_at = [light_order.index(f"20/urgent-{i}") for i in range(3) if f"20/urgent-{i}" in light_order]
    assert len(urgent_at) == 3 and max(urgent_at) < 40, light_order[:40]


def test_a_worker_killed_holding_a_rate_limited_claim_loses_and_duplicates_nothing(account, start_cluster, tmp_path):
    cluster, refs, claimed = kill_a_claimant(account, start_cluster, tmp_path, fault="before_handoff", rate=(3, 2))
    assert claimed.ref == refs[1]
    assert_recovers_once_in_order(account, refs, cluster)
    starts = list(runs_of(account).exclude(outcome__in=[Outcome.DEFERRED, Outcome.REJECTED])
                  .values_list("started_at", flat=True))
    assert most_in_any_window(starts, 2.0) <= 3
    assert Budget.objects.get(account=account).rate_starts == 3
