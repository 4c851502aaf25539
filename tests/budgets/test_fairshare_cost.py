"""The fair-share view reads a bounded part of the holding area: with 100,000 jobs held across
10,000 accounts (tests/scheduling/test_held_work_cost.py's holding area), every statement of a page
load is EXPLAIN ANALYZEd and the rows it reads from the held jobs and from their per-account counts
(Backlog) are counted. The held jobs: one per line shown, read twice (its oldest, by the
deferred_account_age index: when it came and why it waits), however long the line; Backlog: one row per account and queue at
most (the top-N by held work sorts the summary, never the jobs)."""
import pytest

from budgets.fairshare import TOP, fair_share_now
from budgets.models import Account
from scheduling.models import Backlog, DeferredTask
from tests.scheduling.test_held_work_cost import holding_area, orm_rows_read  # noqa: F401  (the fixture)

pytestmark = pytest.mark.django_db

HELD, SUMMARY = DeferredTask._meta.db_table, Backlog._meta.db_table


@pytest.mark.parametrize("search", ["", "x99", "capped"])
def test_the_fair_share_table_reads_one_held_job_per_line_shown(holding_area, search):  # noqa: F811
    rows = []
    read = orm_rows_read(lambda: rows.extend(fair_share_now(accounts=Account.objects.all(), superuser=True,
                                                            search=search, top=TOP)))
    assert rows, "the table shows lines"
    assert read[HELD] <= 2 * len(rows), read  # its oldest job: when it came, and why it waits
    assert read[SUMMARY] <= Backlog.objects.count() + 2 * len(rows), read  # the top-N sort, then the lines shown
    if search == "capped":
        [capped] = rows  # its 9,027-job line: counted, and its oldest job read, not the line
        assert capped.status.held == 9_027 and capped.held_by_reason == {"concurrency_cap": 9_027}
        assert capped.oldest_held_at is not None and capped.status.running + capped.status.sent == 1
    elif search:
        assert all(row.status.account.startswith("x99") for row in rows)
    else:
        # The accounts holding the most work first: the capped one's long line, then 9 each.
        assert rows[0].status.account == "capped" and all(row.status.held >= 9 for row in rows[1:])
