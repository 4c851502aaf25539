"""How many more jobs a queue's workers could start now, as one SQL function for the two statements
that ask it (budgets/ledger/queries.sql `dispatch_or_hold`, every enqueue, within its one statement;
`idle_workers`, an enqueue of a batch), inlined by PostgreSQL as the rules of 0012_sql_rules are
(tests/budgets/test_queries.py)."""
from django.db import migrations

RULE = r"""
-- The queue's running workers (heartbeats seen since `in_live_since`: scheduling.liveness.live_since)
-- less its slots taken (dispatched or active: not reclaimed), at least 0. Reads the queue's live
-- heartbeats (index heartbeat_live: a dead or recycled worker's row, kept for days until the prune, is
-- never read) and the queue's slots in flight (index reservation_in_flight, whose leading expression
-- `NOT (status = 'reclaimed')` is written here as the index names it). Bounded by the workers and the
-- slots taken, never by history.
CREATE OR REPLACE FUNCTION fairshare_idle_workers(in_queue varchar, in_live_since timestamptz)
RETURNS TABLE (idle bigint) LANGUAGE sql STABLE AS $$
  SELECT GREATEST(0,
           (SELECT count(*) FROM scheduling_workerheartbeat h WHERE h.queue = in_queue AND h.seen_at >= in_live_since)
         - (SELECT count(*) FROM budgets_reservation r WHERE (NOT (r.status = 'reclaimed')) AND r.queue = in_queue))
$$;
"""

DROP = "DROP FUNCTION IF EXISTS fairshare_idle_workers(varchar, timestamptz);"


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0015_first_claimable'),
        ('scheduling', '0024_workerheartbeat_heartbeat_live'),
    ]

    operations = [migrations.RunSQL(RULE, DROP)]
