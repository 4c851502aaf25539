"""The first job of an account's line that a claim may take, as one SQL function for the two
statements that claim it (budgets/ledger/queries.sql `claim` and the pass-on of `settle`), inlined
by PostgreSQL as the rules of 0012_sql_rules are (tests/budgets/test_queries.py)."""
from django.db import migrations

RULE = r"""
-- The first held job of the account's line on the queue that a claim may take: unclaimed, or its
-- claim expired before `in_now` and its claimant's slot given back (fairshare_job_slots), locked
-- (SKIP LOCKED: two claimants never take the same job and neither waits for the other). Index
-- deferred_line: the first rows of the line. Its row lock is the calling statement's, so it can only
-- be called inlined, in a FROM (STABLE, as inlining needs; called otherwise PostgreSQL refuses its
-- FOR UPDATE). Use: WHERE id = (SELECT f.id FROM fairshare_first_claimable(...) f WHERE <gate>).
CREATE OR REPLACE FUNCTION fairshare_first_claimable(in_account bigint, in_queue varchar, in_now timestamptz)
RETURNS TABLE (id bigint) LANGUAGE sql STABLE AS $$
  SELECT d.id FROM scheduling_deferredtask d
   WHERE d.account_id = in_account AND d.queue = in_queue AND d.in_line_since IS NOT NULL
     AND (d.claim_expires_at IS NULL OR (d.claim_expires_at < in_now
          AND NOT EXISTS (SELECT 1 FROM fairshare_job_slots(d.account_id, d.queue, d.job, d.ref))))
   ORDER BY d.priority DESC, d.in_line_since, d.id LIMIT 1 FOR UPDATE SKIP LOCKED
$$;
"""

DROP = "DROP FUNCTION IF EXISTS fairshare_first_claimable(bigint, varchar, timestamptz);"


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0014_reservation_reservation_in_flight'),
    ]

    operations = [migrations.RunSQL(RULE, DROP)]
