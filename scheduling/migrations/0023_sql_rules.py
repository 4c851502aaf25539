"""The holding area's rules as SQL functions, for hand-written statements to share (budgets/ledger/
queries.sql): each a LANGUAGE sql STABLE table function of one SELECT, which PostgreSQL inlines
into the statement that calls it in FROM (its plan shows the function's tables, never a call:
tests/scheduling/test_held_work_cost.py EXPLAINs them). Arguments are named in_* so that no column
of the body's tables hides them."""
from django.db import migrations

RULES = r"""
-- The pauses covering an account's work on a queue: the account's on every queue, the account's
-- on this one, or the whole queue's (scheduling.pausing). Use: EXISTS (SELECT 1 FROM ...).
CREATE OR REPLACE FUNCTION fairshare_pauses(in_account bigint, in_queue varchar)
RETURNS TABLE (id bigint) LANGUAGE sql STABLE AS $$
  SELECT p.id FROM scheduling_pause p
   WHERE (p.account_id = in_account AND p.queue IN ('', in_queue)) OR (p.account_id IS NULL AND p.queue = in_queue)
$$;

-- Whether the account has held work in its line on the queue: its one Backlog row by its unique
-- key (the condition on the row, not in the WHERE, so that no other index can look better).
CREATE OR REPLACE FUNCTION fairshare_in_line(in_account bigint, in_queue varchar)
RETURNS TABLE (in_line boolean) LANGUAGE sql STABLE AS $$
  SELECT COALESCE((SELECT k.in_line > 0 FROM scheduling_backlog k
                    WHERE k.account_id = in_account AND k.queue = in_queue), FALSE)
$$;

-- The accounts whose line on the queue could go now: something in line, not held up (the
-- constant, not a parameter: the planner knows from the statistics how few lines could go, also
-- in a prepared statement's generic plan), not paused (scheduling.holding.ready); with when the
-- first job of each line joined it. Index backlog_ready, then each line's head by deferred_line.
CREATE OR REPLACE FUNCTION fairshare_ready_accounts(in_queue varchar)
RETURNS TABLE (account_id bigint, head_since timestamptz) LANGUAGE sql STABLE AS $$
  SELECT k.account_id,
         (SELECT d.in_line_since FROM scheduling_deferredtask d
           WHERE d.account_id = k.account_id AND d.queue = k.queue AND d.in_line_since IS NOT NULL
           ORDER BY d.priority DESC, d.in_line_since, d.id LIMIT 1)
    FROM scheduling_backlog k
   WHERE k.queue = in_queue AND k.lined AND k.blocked_until = '1970-01-01 00:00:00+00'::timestamptz
     AND NOT EXISTS (SELECT 1 FROM fairshare_pauses(k.account_id, k.queue))
$$;

-- Whether any account's line on the queue could go now (pauses aside: a paused account's line
-- makes a free worker look, and find nothing). Index backlog_ready.
CREATE OR REPLACE FUNCTION fairshare_any_ready(in_queue varchar)
RETURNS TABLE (waiting boolean) LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM scheduling_backlog k WHERE k.queue = in_queue AND k.lined
                    AND k.blocked_until = '1970-01-01 00:00:00+00'::timestamptz)
$$;

-- A rate limit's window: the account's latest `in_limit` starts on the queue within `in_period_s`
-- before `in_now` (TaskRun's clock, the database's), latest first. At most `in_limit` entries
-- of index taskrun_account_queue_started, whatever the history holds.
CREATE OR REPLACE FUNCTION fairshare_window(in_account bigint, in_queue varchar, in_limit bigint,
                                            in_period_s bigint, in_now timestamptz)
RETURNS TABLE (started_at timestamptz) LANGUAGE sql STABLE AS $$
  SELECT t.started_at FROM scheduling_taskrun t
   WHERE t.account_id = in_account AND t.queue = in_queue
     AND t.started_at > in_now - make_interval(secs => in_period_s)
     AND t.outcome NOT IN ('deferred', 'rejected')
   ORDER BY t.started_at DESC LIMIT in_limit
$$;
"""

DROP = """
DROP FUNCTION IF EXISTS fairshare_window(bigint, varchar, bigint, bigint, timestamptz);
DROP FUNCTION IF EXISTS fairshare_any_ready(varchar);
DROP FUNCTION IF EXISTS fairshare_ready_accounts(varchar);
DROP FUNCTION IF EXISTS fairshare_in_line(bigint, varchar);
DROP FUNCTION IF EXISTS fairshare_pauses(bigint, varchar);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('scheduling', '0022_dead_letter'),
    ]

    operations = [migrations.RunSQL(RULES, DROP)]
