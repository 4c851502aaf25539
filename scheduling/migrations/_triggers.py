"""The triggers that keep Backlog's counts (scheduling.models.Backlog, a column per DeferReason) on
scheduling_deferredtask, written for the reasons a migration knows, so an old migration keeps
creating the triggers it always created. Per statement for inserts and deletes (transition tables:
a bulk hold updates its account's Backlog row once, not once per job), per changed row for a change
of a row's account, queue, place in line or reason (a claim, which changes none, fires nothing).
"""
from dataclasses import dataclass

from django.db import migrations

NOT_BLOCKED = "TIMESTAMPTZ '1970-01-01 00:00:00+00'"


@dataclass(frozen=True)
class Triggers:
    reasons: tuple[str, ...]
    # Count each reason only for the jobs out of their account's line (waiting for a time of their
    # own): a job in line waits for its line (scheduling.waits). Migrations before 0021 counted all.
    own_time: bool = False

    @property
    def counts(self) -> tuple[str, ...]:
        """Backlog's count columns, in this order everywhere."""
        return ("held", "in_line", *self.reasons)

    def _counted(self, row: str = "") -> tuple[str, ...]:
        """Each count in `counts`' order: of a set of held rows, or of one `row` (`OLD`, `NEW`) as 0/1."""
        out_of_line = f" AND {f'{row}.' if row else ''}in_line_since IS NULL" if self.own_time else ""
        if not row:
            return ("count(*)", "count(in_line_since)",
                    *(f"count(*) FILTER (WHERE reason = '{r}'{out_of_line})" for r in self.reasons))
        return ("1", f"(CASE WHEN {row}.in_line_since IS NULL THEN 0 ELSE 1 END)",
                *(f"(CASE WHEN {row}.reason = '{r}'{out_of_line} THEN 1 ELSE 0 END)" for r in self.reasons))

    def _upsert(self, counts_sql: str) -> str:
        """Add counts, given as a SELECT of (account_id, queue, *counts, blocked_until), to Backlog."""
        updates = ", ".join(f"{c} = scheduling_backlog.{c} + EXCLUDED.{c}" for c in self.counts)
        return (f"INSERT INTO scheduling_backlog (account_id, queue, {', '.join(self.counts)}, blocked_until) "
                f"{counts_sql} ON CONFLICT (account_id, queue) DO UPDATE SET {updates}")

    def postgresql(self) -> str:
        counts, counted = self.counts, self._counted()
        # The rows a statement inserted, counted per account and queue (in that order: every
        # statement locks its Backlog rows in one order, so two of them never wait for each other).
        added = (f"SELECT account_id, queue, {', '.join(counted)}, {NOT_BLOCKED} FROM added "
                 "WHERE account_id IS NOT NULL GROUP BY account_id, queue ORDER BY account_id, queue")
        taken = ", ".join(f"{c} = {c} - {v}" for c, v in zip(counts, self._counted("OLD")))
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
    UPDATE scheduling_backlog SET {taken} WHERE account_id = OLD.account_id AND queue = OLD.queue;
  END IF;
  IF NEW.account_id IS NOT NULL THEN
    {self._upsert(f"VALUES (NEW.account_id, NEW.queue, {', '.join(self._counted('NEW'))}, {NOT_BLOCKED})")};
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

    def create(self, apps, schema_editor) -> None:
        """Create the triggers (a migration's RunPython function)."""
        schema_editor.execute(self.postgresql())


def drop(apps, schema_editor) -> None:
    """Drop the triggers (a migration's RunPython function)."""
    schema_editor.execute("""
DROP TRIGGER scheduling_backlog_recount ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_take ON scheduling_deferredtask;
DROP TRIGGER scheduling_backlog_add ON scheduling_deferredtask;
DROP FUNCTION scheduling_backlog_recount();
DROP FUNCTION scheduling_backlog_take();
DROP FUNCTION scheduling_backlog_add();
""")


def rewritten(before: Triggers, after: Triggers, *operations) -> list:
    """A migration's `operations` between the triggers dropped and created again with `after`'s
    reasons (backwards: with `before`'s)."""
    return [migrations.RunPython(drop, before.create), *operations, migrations.RunPython(after.create, drop)]
