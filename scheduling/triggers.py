"""The triggers that keep Backlog's counts (scheduling.models.Backlog) on scheduling_deferredtask,
written for a given list of DeferReasons (Backlog has one count column per reason): the migrations
that create them (0012_backlog) and rewrite them when a reason comes (0014_rate_limited) each pass
the reasons they know, so an old migration keeps creating the triggers it always created.

On PostgreSQL: per statement for inserts and deletes (transition tables: a bulk hold of thousands
of one account's jobs updates its Backlog row once, not once per job, which within one transaction
would leave a version of that row per job), and per changed row for a change of a row's account,
queue, place in line or reason (a claim, which changes none of these, fires nothing).
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Triggers:
    reasons: tuple[str, ...]
    # Count each reason only for the jobs out of their account's line (waiting for a time of their
    # own): a job in line waits for whatever its line waits for now (scheduling.waits), and the
    # reason it was held for goes stale. Migrations before 0021 counted every held job.
    own_time: bool = False

    @property
    def counts(self) -> tuple[str, ...]:
        """Backlog's count columns, in this order everywhere."""
        return ("held", "in_line", *self.reasons)

    def _counted(self) -> tuple[str, ...]:
        """Each count of a set of held rows, in `counts`' order (PostgreSQL aggregates)."""
        out_of_line = " AND in_line_since IS NULL" if self.own_time else ""
        return ("count(*)", "count(in_line_since)",
                *(f"count(*) FILTER (WHERE reason = '{r}'{out_of_line})" for r in self.reasons))

    def _row_counts(self, row: str) -> str:
        """Each count of one row (`OLD`, `NEW`), in `counts`' order, as 0 or 1."""
        out_of_line = f" AND {row}.in_line_since IS NULL" if self.own_time else ""
        return ", ".join(["1", f"(CASE WHEN {row}.in_line_since IS NULL THEN 0 ELSE 1 END)",
                          *(f"(CASE WHEN {row}.reason = '{reason}'{out_of_line} THEN 1 ELSE 0 END)"
                            for reason in self.reasons)])

    def _upsert(self, counts_sql: str) -> str:
        """Add counts, given as a SELECT of (account_id, queue, *counts, blocked_until), to Backlog."""
        columns = ", ".join(self.counts)
        updates = ", ".join(f"{c} = scheduling_backlog.{c} + EXCLUDED.{c}" for c in self.counts)
        return (f"INSERT INTO scheduling_backlog (account_id, queue, {columns}, blocked_until) {counts_sql} "
                f"ON CONFLICT (account_id, queue) DO UPDATE SET {updates}")

    def _take(self, values: str, *, where: str) -> str:
        """Take counts (`values`: expressions in `counts`' order) from the Backlog row `where` names."""
        return ("UPDATE scheduling_backlog SET "
                + ", ".join(f"{c} = {c} - {v}" for c, v in zip(self.counts, values.split(", "))) + f" WHERE {where}")

    def postgresql(self) -> str:
        counts, counted = self.counts, self._counted()
        # The rows a statement inserted, counted per account and queue (in that order: every
        # statement locks its Backlog rows in one order, so two of them never wait for each other).
        added = (f"SELECT account_id, queue, {', '.join(counted)}, TIMESTAMPTZ '1970-01-01 00:00:00+00' FROM added "
                 "WHERE account_id IS NOT NULL GROUP BY account_id, queue ORDER BY account_id, queue")
        return f"""
CREATE FUNCTION scheduling_backlog_add() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  {self._upsert(added)};
  RETURN NULL;
END $$;
CREATE FUNCTION scheduling_backlog_take() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  UPDATE scheduling_backlog k SET {", ".join(f"{c} = k.{c} - d.{c}" for c in counts)}
    FROM (SELECT account_id, queue, {", ".join(f"{agg} AS {c}" for agg, c in zip(counted, counts))}
            FROM taken WHERE account_id IS NOT NULL GROUP BY account_id, queue) d
   WHERE k.account_id = d.account_id AND k.queue = d.queue;
  RETURN NULL;
END $$;
CREATE FUNCTION scheduling_backlog_recount() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF OLD.account_id IS NOT NULL THEN
    {self._take(self._row_counts("OLD"), where="account_id = OLD.account_id AND queue = OLD.queue")};
  END IF;
  IF NEW.account_id IS NOT NULL THEN
    {self._upsert(f"VALUES (NEW.account_id, NEW.queue, {self._row_counts('NEW')}, TIMESTAMPTZ '1970-01-01 00:00:00+00')")};
  END IF;
  RETURN NULL;
END $$;
CREATE TRIGGER scheduling_backlog_add AFTER INSERT ON scheduling_deferredtask
  REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION scheduling_backlog_add();
CREATE TRIGGER scheduling_backlog_take AFTER DELETE ON scheduling_deferredtask
  REFERENCING OLD TABLE AS taken FOR EACH STATEMENT EXECUTE FUNCTION scheduling_backlog_take();
CREATE TRIGGER scheduling_backlog_recount AFTER UPDATE OF account_id, queue, in_line_since, reason
  ON scheduling_deferredtask FOR EACH ROW
  WHEN (OLD.account_id IS DISTINCT FROM NEW.account_id OR OLD.queue IS DISTINCT FROM NEW.queue
        OR (OLD.in_line_since IS NULL) <> (NEW.in_line_since IS NULL) OR OLD.reason IS DISTINCT FROM NEW.reason)
  EXECUTE FUNCTION scheduling_backlog_recount();
"""

    def create(self, schema_editor) -> None:
        schema_editor.execute(self.postgresql())

    def created(self, apps, schema_editor) -> None:
        """`create`, as a migration's RunPython function."""
        self.create(schema_editor)


def dropped(apps, schema_editor) -> None:
    """`drop`, as a migration's RunPython function."""
    drop(schema_editor)


def rewritten(before: Triggers, after: Triggers, *operations) -> list:
    """A migration's operations that change what the triggers count (a new reason's Backlog
    column): the triggers dropped before them and created again after them with `after`'s reasons
    (backwards: dropped, the operations undone, created with `before`'s)."""
    from django.db import migrations

    return [migrations.RunPython(dropped, before.created), *operations, migrations.RunPython(after.created, dropped)]


POSTGRESQL_DROP = """
DROP TRIGGER scheduling_backlog_recount ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_take ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_add ON scheduling_deferredtask;
DROP FUNCTION scheduling_backlog_recount();
DROP FUNCTION scheduling_backlog_take();
DROP FUNCTION scheduling_backlog_add();
"""


def drop(schema_editor) -> None:
    schema_editor.execute(POSTGRESQL_DROP)
