-- The three statements every Django task call pays for (tasks/statements.py), kept whole and loaded
-- once (scheduling.db.load_queries). What each reads as the data grows: one row of budgets_account
-- by its primary key (the insert's check that the account is there and active); one row of
-- tasks_taskcall by its primary key (claim, completion), and for the claim sent along with the
-- run's admission the call's runs (index taskrun_ref: one per attempt or delivery). None grows with
-- the calls kept, waiting or running, or with the runs on record (tests/tasks/test_statements.py
-- EXPLAINs them on large tables).

-- name: insert
-- A new call. Its account is written only if it exists and is active (a scalar sub-select by its
-- id, NULL otherwise: also for a call without one), and RETURNING says which, so the check costs no
-- round trip of its own; the parameters stay in VALUES, where PostgreSQL types them by column.
INSERT INTO tasks_taskcall (id, backend, task_path, account_id, queue, priority, run_after, arguments, status,
                            return_value, errors, workers, attempt_count, attempt_limit, run_id, enqueued_at,
                            sent_at, started_at, last_attempted_at, finished_at)
VALUES (%(id)s, %(backend)s, %(task_path)s,
        (SELECT a.id FROM budgets_account a WHERE a.id = %(account_id)s AND a.is_active), %(queue)s, %(priority)s,
        %(run_after)s, %(arguments)s, %(status)s, %(return_value)s, %(errors)s, %(workers)s, %(attempt_count)s,
        %(attempt_limit)s, %(run_id)s, %(enqueued_at)s, %(sent_at)s, %(started_at)s, %(last_attempted_at)s,
        %(finished_at)s)
RETURNING account_id;

-- name: claim
-- READY -> RUNNING for the run %(run_id)s on a worker, returning the call as the claim left it; no
-- row when the call was not READY with an attempt left. Two deliveries of one message: the row
-- lock of the UPDATE makes the second find the call RUNNING.
UPDATE tasks_taskcall
   SET status = 'RUNNING', run_id = %(run_id)s, workers = workers || %(worker)s, attempt_count = attempt_count + 1,
       started_at = COALESCE(started_at, %(now)s), last_attempted_at = %(now)s
 WHERE id = %(call_id)s AND status = 'READY' AND attempt_count < attempt_limit
RETURNING *;

-- name: claim_along
-- `claim`, sent in the round trip and transaction of the run's admission (scheduling.db.send_along,
-- after it): the run is the one that admission has just recorded as started for this call on this
-- worker, known by its start time (%(run_started_at)s, set with the admission's parameters), looked
-- up among the call's runs; no row when the admission recorded none (refused, held, or it decided
-- nothing: the handler then claims on its own, `claim`). Returns the call's row as the claim left
-- it and what the claim changed as it was (`prior_*`), so that a run that then does not run the
-- call (a pause found by its admission) gives it back exactly as it found it. Two deliveries: as
-- `claim` (the row lock of the UPDATE, taken first by `p`).
WITH p AS (SELECT id, run_id, started_at, last_attempted_at FROM tasks_taskcall WHERE id = %(call_id)s FOR UPDATE)
UPDATE tasks_taskcall c
   SET status = 'RUNNING', run_id = t.id, workers = c.workers || %(worker)s, attempt_count = c.attempt_count + 1,
       started_at = COALESCE(c.started_at, %(now)s), last_attempted_at = %(now)s
  FROM p, scheduling_taskrun t
 WHERE c.id = p.id AND c.status = 'READY' AND c.attempt_count < c.attempt_limit
   AND t.ref = %(ref)s AND t.job = %(job)s AND t.worker = %(run_worker)s AND t.started_at = %(run_started_at)s
   AND t.outcome = 'running'
RETURNING c.*, p.run_id AS prior_run_id, p.started_at AS prior_started_at,
          p.last_attempted_at AS prior_last_attempted_at;

-- name: complete
-- RUNNING -> SUCCESSFUL, while the run %(run_id)s still holds the call. Sent along with the run's
-- settlement (scheduling.db.send_along), in its round trip and transaction, when it has one.
UPDATE tasks_taskcall SET status = 'SUCCESSFUL', return_value = %(return_value)s, finished_at = %(now)s
 WHERE id = %(call_id)s AND status = 'RUNNING' AND run_id = %(run_id)s
RETURNING 1 AS completed;
