"""The ledger's rules as SQL functions, for its statements to share (budgets/ledger/queries.sql):
each a LANGUAGE sql function of one SELECT that PostgreSQL inlines into the statement calling it
(a STABLE table function called in FROM; `fairshare_unreserved` an IMMUTABLE expression), so its
plan shows the tables, never a call (tests/scheduling/test_held_work_cost.py EXPLAINs them).
Arguments are named in_* so that no column of the body's tables hides them."""
from django.db import migrations

RULES = r"""
-- "Unreserved CPU" (ms): the daily limit (CPU seconds) less what the day's usage row records as
-- used and reserved (NULL: no usage row yet, nothing used).
CREATE OR REPLACE FUNCTION fairshare_unreserved(in_limit_s bigint, in_used_ms bigint, in_reserved_ms bigint)
RETURNS bigint LANGUAGE sql IMMUTABLE AS $$
  SELECT in_limit_s * 1000 - COALESCE(in_used_ms, 0) - COALESCE(in_reserved_ms, 0)
$$;

-- The account's slots taken on the queue (dispatched or running: "free slots" is the cap less
-- these), and those running (ACTIVE) but the slot `in_but` (NULL: none). Index reservation_slots:
-- bounded by the account's cap, not by its held work.
CREATE OR REPLACE FUNCTION fairshare_taken(in_account bigint, in_queue varchar)
RETURNS TABLE (taken bigint) LANGUAGE sql STABLE AS $$
  SELECT COUNT(*) FROM budgets_reservation x
   WHERE x.account_id = in_account AND x.queue = in_queue AND x.status IN ('dispatched', 'active')
$$;

CREATE OR REPLACE FUNCTION fairshare_running(in_account bigint, in_queue varchar, in_but bigint)
RETURNS TABLE (running bigint) LANGUAGE sql STABLE AS $$
  SELECT COUNT(*) FROM budgets_reservation x
   WHERE x.account_id = in_account AND x.queue = in_queue AND x.status = 'active' AND x.id IS DISTINCT FROM in_but
$$;

-- A job's slots taken (dispatched or running), by (job, ref) in index reservation_slots. A held
-- job whose claim expired is let go (may be taken over) only when it has none: until the reclaim
-- gives the claim's slot back, its claimant may have started the run (a start writes nothing to
-- the slot), and whoever took it over would run it a second time.
CREATE OR REPLACE FUNCTION fairshare_job_slots(in_account bigint, in_queue varchar, in_job varchar, in_ref varchar)
RETURNS TABLE (id bigint, status varchar) LANGUAGE sql STABLE AS $$
  SELECT c.id, c.status FROM budgets_reservation c
   WHERE c.account_id = in_account AND c.queue = in_queue AND c.status IN ('dispatched', 'active')
     AND c.job = in_job AND c.ref = in_ref
$$;

-- "A job sent to the broker on the queue waits for a worker": a dispatched slot sent in the
-- broker window (budgets.ledger.reads.broker_window) whose job is not held (a claimed job's slot
-- is not one). Index reservation_age over that window, each job's held row by (job, ref).
CREATE OR REPLACE FUNCTION fairshare_broker_waiting(in_queue varchar, in_since timestamptz, in_forgets timestamptz)
RETURNS TABLE (waiting boolean) LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM budgets_reservation w
                  WHERE w.queue = in_queue AND w.status = 'dispatched' AND w.created_at < in_since
                    AND w.created_at > in_forgets
                    AND NOT EXISTS (SELECT 1 FROM scheduling_deferredtask h WHERE h.job = w.job AND h.ref = w.ref))
$$;

-- "Another account's turn comes first": one whose line on the queue could go, below its cap, with
-- fewer slots in use for its weight than the settling account `in_account` has once its run's
-- slot is freed (ties: the settling account keeps its turn). Reads to the first such account.
CREATE OR REPLACE FUNCTION fairshare_others_ready(in_account bigint, in_queue varchar)
RETURNS TABLE (others_waiting boolean) LANGUAGE sql STABLE AS $$
  SELECT EXISTS (
    SELECT 1 FROM fairshare_ready_accounts(in_queue) k
      LEFT JOIN budgets_budget b ON b.account_id = k.account_id AND b.queue = in_queue
      CROSS JOIN LATERAL fairshare_taken(k.account_id, in_queue) s
     WHERE k.account_id <> in_account AND s.taken < COALESCE(b.max_concurrent, 1)
       AND s.taken::float / COALESCE(b.weight, 1)
           < (SELECT (m.taken - 1)::float / mb.weight FROM fairshare_taken(in_account, in_queue) m,
                     budgets_budget mb WHERE mb.account_id = in_account AND mb.queue = in_queue))
$$;

-- Whether the account's run ending on the queue may pass its slot `in_but` on to its next held job
-- (budgets/ledger/queries.sql `settle`): no pause covers it, fewer than its cap run but that slot
-- (an operator may have lowered it), it has no rate limit (decided under the lock), no other
-- account's turn comes first (then the slot goes by the fair order) and no job waits in the broker.
CREATE OR REPLACE FUNCTION fairshare_may_pass_on(in_account bigint, in_queue varchar, in_but bigint,
                                                 in_since timestamptz, in_forgets timestamptz)
RETURNS TABLE (may boolean) LANGUAGE sql STABLE AS $$
  SELECT EXISTS (SELECT 1 FROM budgets_budget b, fairshare_running(in_account, in_queue, in_but) s
                  WHERE b.account_id = in_account AND b.queue = in_queue AND b.rate_starts IS NULL
                    AND s.running < b.max_concurrent)
     AND NOT EXISTS (SELECT 1 FROM fairshare_pauses(in_account, in_queue))
     AND NOT (SELECT others_waiting FROM fairshare_others_ready(in_account, in_queue))
     AND NOT (SELECT waiting FROM fairshare_broker_waiting(in_queue, in_since, in_forgets))
$$;
"""

DROP = """
DROP FUNCTION IF EXISTS fairshare_may_pass_on(bigint, varchar, bigint, timestamptz, timestamptz);
DROP FUNCTION IF EXISTS fairshare_others_ready(bigint, varchar);
DROP FUNCTION IF EXISTS fairshare_broker_waiting(varchar, timestamptz, timestamptz);
DROP FUNCTION IF EXISTS fairshare_job_slots(bigint, varchar, varchar, varchar);
DROP FUNCTION IF EXISTS fairshare_running(bigint, varchar, bigint);
DROP FUNCTION IF EXISTS fairshare_taken(bigint, varchar);
DROP FUNCTION IF EXISTS fairshare_unreserved(bigint, bigint, bigint);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0011_reservation_carried_charges'),
        ('scheduling', '0023_sql_rules'),
    ]

    operations = [migrations.RunSQL(RULES, DROP)]
