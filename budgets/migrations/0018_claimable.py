"""The first `in_limit` jobs of an account's line that a claim or a release may take, one SQL function
for the three statements that take them (budgets/ledger/queries.sql `claim`, `settle`'s pass-on and
`release`): the release's ORM copy of the rule goes (budgets.ledger.reads.may_take_over)."""
import importlib

from django.db import migrations

RULE = r"""
DROP FUNCTION IF EXISTS fairshare_first_claimable(bigint, varchar, timestamptz);
-- The first `in_limit` held jobs of the account's line on the queue that a claim or release may
-- take: unclaimed, or its claim expired before `in_now` and its claimant's slot given back
-- (fairshare_job_slots), locked (SKIP LOCKED: two takers never take the same job and neither waits
-- for the other). Index deferred_line: the first rows of the line. Its row lock is the calling
-- statement's, so it can only be called inlined, in a FROM (STABLE, as inlining needs; called
-- otherwise PostgreSQL refuses its FOR UPDATE). Use: WHERE id = (SELECT f.id FROM
-- fairshare_claimable(..., 1) f WHERE <gate>), or WHERE id IN (SELECT ...).
CREATE OR REPLACE FUNCTION fairshare_claimable(in_account bigint, in_queue varchar, in_now timestamptz,
                                               in_limit bigint)
RETURNS TABLE (id bigint) LANGUAGE sql STABLE AS $$
  SELECT d.id FROM scheduling_deferredtask d
   WHERE d.account_id = in_account AND d.queue = in_queue AND d.in_line_since IS NOT NULL
     AND (d.claim_expires_at IS NULL OR (d.claim_expires_at < in_now
          AND NOT EXISTS (SELECT 1 FROM fairshare_job_slots(d.account_id, d.queue, d.job, d.ref))))
   ORDER BY d.priority DESC, d.in_line_since, d.id LIMIT in_limit FOR UPDATE SKIP LOCKED
$$;
"""

BACK = ("DROP FUNCTION IF EXISTS fairshare_claimable(bigint, varchar, timestamptz, bigint);"
        + importlib.import_module("budgets.migrations.0015_first_claimable").RULE)


class Migration(migrations.Migration):

    dependencies = [
        ('budgets', '0017_statement_defaults'),
    ]

    operations = [migrations.RunSQL(RULE, BACK)]
