"""What every job updates stays off the indexes: the rows a job's path updates (its run's record at
its end, its held row's claim, its account's Backlog row through the triggers, its day's usage
through the settlement's charge) change no column that an index of their table names, as a key,
an included column, an expression or a condition. PostgreSQL can then keep each new version on
the row's page (a HOT update) and write no index entry for it; one changed indexed column and the
update writes an entry in every index of the table, for every job."""
import re

import pytest
from django.db import connection

from budgets.ledger.reads import QUERIES
from budgets.models import UsageDay
from scheduling.metering import Meter
from scheduling.models import Backlog, DeferReason, DeferredTask, Outcome, TaskRun
from scheduling.services import RunEnd

pytestmark = pytest.mark.django_db


def indexed_columns(table: str) -> dict[str, set[str]]:
    """Each index of `table` and the columns it names (keys, INCLUDE, expressions, condition)."""
    with connection.cursor() as cursor:
        cursor.execute("""
            SELECT i.indexrelid::regclass::text, a.attname,
                   COALESCE(pg_get_expr(i.indexprs, i.indrelid), '') || ' ' || COALESCE(pg_get_expr(i.indpred, i.indrelid), '')
              FROM pg_index i LEFT JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
             WHERE i.indrelid = %s::regclass""", [table])
        rows = cursor.fetchall()
        cursor.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0", [table])
        columns = {name for (name,) in cursor.fetchall()}
    named: dict[str, set[str]] = {}
    for index, column, expressions in rows:
        words = set(re.findall(r"\w+", expressions)) & columns
        named.setdefault(index, set()).update(words | ({column} if column else set()))
    return named


def set_columns(statement: str) -> set[str]:
    """The columns an UPDATE statement's SET clause assigns."""
    clause = re.search(r"\bSET\b(.*?)\b(?:WHERE|FROM)\b", statement, re.S).group(1)
    return set(re.findall(r"(?:^|,)\s*\"?(\w+)\"?\s*=", clause))


def test_the_updates_on_a_jobs_path_change_no_indexed_column():
    end = RunEnd(meter=Meter(), outcome=Outcome.SUCCEEDED, items=1)
    updated = {
        TaskRun._meta.db_table: set(end.values()),  # the run's end (the settlement's statement)
        DeferredTask._meta.db_table: set_columns(QUERIES["claim"]),  # the claim of the job a slot goes to
        # The triggers' counts, for every job held or let go (scheduling.migrations._triggers).
        Backlog._meta.db_table: {"held", "in_line", *DeferReason.values},
        UsageDay._meta.db_table: set_columns(QUERIES["settle"][QUERIES["settle"].index("UPDATE budgets_usageday"):]),  # the settlement's charge
    }
    assert {"outcome", "finished_at"} <= updated[TaskRun._meta.db_table]
    assert updated[DeferredTask._meta.db_table] == {"claimed_by", "claim_expires_at"}
    assert {"cpu_used_ms", "cpu_reserved_ms", "runs"} <= updated[UsageDay._meta.db_table]
    for table, columns in updated.items():
        for index, named in indexed_columns(table).items():
            assert not named & columns, f"index {index} names {sorted(named & columns)}, updated for every job"
