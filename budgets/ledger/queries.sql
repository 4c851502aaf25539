-- The ledger's statements, one a transition of a slot (the map: budgets/ledger/__init__.py), loaded
-- once by scheduling.db.load_queries, sent prepared. Shared rules are SQL functions (fairshare_*:
-- migrations scheduling 0023, budgets 0012 and 0013) that PostgreSQL inlines. `now` is the kernel's
-- clock (scheduling.clock); slots' times (created_at, leases) and `wall_now` are the wall clock's.
-- Above each: what it reads as held jobs, accounts and history grow (EXPLAINed on 100,000 held jobs
-- and 10,000 accounts: tests/scheduling/test_held_work_cost.py).

-- name: lock
-- The account's lock (budgets.locks): a write that changes nothing gives the row a new version
-- (xmin) each time, which admit_at_once checks. One row by key.
UPDATE budgets_budget SET max_concurrent = max_concurrent
 WHERE account_id = %(account_id)s AND queue = %(queue)s
RETURNING 1 AS locked;

-- name: standing
-- The account's standing (budgets.standing.Standing): Budget, usage row and Backlog by key, its
-- slots (bounded by its cap), the job's own dispatched slot, its pauses; rate-limited, at most
-- 2 x rate_starts TaskRun index entries.
SELECT b.cpu_seconds_per_day::bigint * 1000 AS cpu_limit_ms, b.max_concurrent, u.id AS usage_id,
       COALESCE(u.cpu_used_ms, 0) AS cpu_used_ms, COALESCE(u.cpu_reserved_ms, 0) AS cpu_reserved_ms,
       CASE WHEN o.id IS NULL THEN (SELECT taken FROM fairshare_taken(b.account_id, b.queue)) END AS in_flight,
       (SELECT running FROM fairshare_running(b.account_id, b.queue, NULL)) AS active,
       (SELECT in_line FROM fairshare_in_line(b.account_id, b.queue)) AS in_line,
       COALESCE((SELECT k.blocked_until > %(now)s FROM scheduling_backlog k
                  WHERE k.account_id = b.account_id AND k.queue = b.queue), FALSE) AS blocked,
       o.id AS own_slot, EXISTS (SELECT 1 FROM fairshare_pauses(b.account_id, b.queue)) AS paused,
       b.weight, b.rate_starts, b.rate_period_s,
       CASE WHEN b.rate_starts IS NOT NULL THEN (
         SELECT COUNT(*) FROM fairshare_window(b.account_id, b.queue, b.rate_starts, b.rate_period_s, %(wall_now)s))
       ELSE 0 END AS recent_starts,
       CASE WHEN b.rate_starts IS NOT NULL THEN (
         SELECT MIN(w.started_at) + make_interval(secs => b.rate_period_s)
           FROM fairshare_window(b.account_id, b.queue, b.rate_starts, b.rate_period_s, %(wall_now)s) w
         HAVING COUNT(*) >= b.rate_starts) END AS rate_frees_at
  FROM budgets_budget b
  LEFT JOIN budgets_usageday u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %(day)s
  LEFT JOIN LATERAL (SELECT MIN(j.id) AS id FROM fairshare_job_slots(b.account_id, b.queue, %(job)s, %(ref)s) j
                      WHERE j.status = 'dispatched') o ON TRUE
 WHERE b.account_id = %(account_id)s AND b.queue = %(queue)s;

-- name: dispatch_or_hold
-- The enqueue check without the lock, for an account with budget left, a free slot, no slot of
-- the job's own and no rate limit (`a`; else `decided` is false: the lock decides). The job takes
-- a dispatched slot (`d`) when its line is empty, a worker is free (`i`; %(live_since)s NULL: no
-- pulse, no bound) and no broker job waits; else it is held (`h`: behind its line, or workers
-- busy, for a busy worker's loop to take in fair order), its deferral counted (`c`; no usage row
-- yet: the lock decides). Reads the account's rows by key, the queue's live heartbeats, slots in
-- flight and slots sent in the broker window.
WITH i AS (
  SELECT %(live_since)s::timestamptz IS NULL
         OR (SELECT idle FROM fairshare_idle_workers(%(queue)s, %(live_since)s::timestamptz)) > 0 AS workers_free),
a AS (
  SELECT b.account_id, u.id AS usage_id, (SELECT in_line FROM fairshare_in_line(b.account_id, b.queue)) AS in_line,
         (NOT (SELECT workers_free FROM i)
          OR (SELECT waiting FROM fairshare_broker_waiting(%(queue)s, %(broker_since)s, %(broker_forgets)s))) AS busy
    FROM budgets_budget b
    LEFT JOIN budgets_usageday u ON u.account_id = b.account_id AND u.queue = b.queue AND u.day = %(day)s
   WHERE b.account_id = %(account_id)s AND b.queue = %(queue)s AND b.rate_starts IS NULL
     AND fairshare_unreserved(b.cpu_seconds_per_day, u.cpu_used_ms, u.cpu_reserved_ms) > 0
     AND b.max_concurrent > (SELECT taken FROM fairshare_taken(b.account_id, b.queue))
     AND NOT EXISTS (SELECT 1 FROM fairshare_job_slots(b.account_id, b.queue, %(job)s, %(ref)s) j
                      WHERE j.status = 'dispatched')),
d AS (
  INSERT INTO budgets_reservation (account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker,
                                   cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms, task_run_id)
  SELECT a.account_id, %(queue)s, %(day)s, %(job)s, %(ref)s, 'dispatched', %(lease)s, %(created_at)s, '', 0, 0, 0, NULL
    FROM a WHERE NOT a.in_line AND NOT a.busy
  RETURNING id),
w AS (SELECT a.in_line FROM a WHERE (a.in_line OR a.busy) AND a.usage_id IS NOT NULL),
h AS (
  INSERT INTO scheduling_deferredtask (account_id, queue, job, ref, reason, eligible_at, created_at, in_line_since,
                                       deferrals, priority, claimed_by, claim_expires_at, envelope_version, message)
  SELECT %(account_id)s, %(queue)s, %(job)s, %(ref)s,
         CASE WHEN w.in_line THEN 'queued_behind' ELSE 'workers_busy' END, %(now)s, %(created_at)s, %(now)s, 1,
         %(priority)s, '', NULL, 1, NULL
    FROM w
  ON CONFLICT (job, ref) DO NOTHING RETURNING 1),
c AS (
  UPDATE budgets_usageday SET deferrals = deferrals + 1
   WHERE id = (SELECT usage_id FROM a) AND EXISTS (SELECT 1 FROM h) RETURNING 1)
SELECT EXISTS (SELECT 1 FROM d) OR EXISTS (SELECT 1 FROM h) AS decided, (SELECT id FROM d) AS slot_id,
       (SELECT workers_free FROM i) AS workers_free;

-- name: admit_at_once
-- DISPATCHED (its own) -> ACTIVE without the lock first: it writes the Budget row as the lock
-- does (`b`), only if the row is still the version its snapshot saw (else a lock holder committed
-- since, and nothing happens). Holding that row, its counts are as exact as under the lock: the
-- running slots (`s`; only lock holders add one), its own slot (`o`), the budget by a conditional
-- UPDATE of the usage row's latest version (`u`). Then the run (`t`) and the slot (`k`). A
-- rate-limited account is left to the lock. Rows by key and the account's slots.
WITH b AS (
  UPDATE budgets_budget SET max_concurrent = max_concurrent
   WHERE account_id = %(account_id)s AND queue = %(queue)s
     AND xmin = (SELECT xmin FROM budgets_budget WHERE account_id = %(account_id)s AND queue = %(queue)s)
  RETURNING account_id, queue, cpu_seconds_per_day, max_concurrent, rate_starts),
o AS (
  SELECT r.id FROM budgets_reservation r
   WHERE r.id = (SELECT MIN(j.id) FROM fairshare_job_slots(%(account_id)s, %(queue)s, %(job)s, %(ref)s) j
                  WHERE j.status = 'dispatched')
     AND r.status = 'dispatched'
  FOR UPDATE),
s AS (
  SELECT o.id AS own_id, b.cpu_seconds_per_day FROM b, o
   WHERE (SELECT running FROM fairshare_running(b.account_id, b.queue, NULL)) < b.max_concurrent
     AND b.rate_starts IS NULL),
u AS (
  UPDATE budgets_usageday AS day_usage SET cpu_reserved_ms = day_usage.cpu_reserved_ms + %(reserve_ms)s FROM s
   WHERE day_usage.account_id = %(account_id)s AND day_usage.queue = %(queue)s AND day_usage.day = %(day)s
     AND fairshare_unreserved(s.cpu_seconds_per_day, day_usage.cpu_used_ms, day_usage.cpu_reserved_ms) >= %(reserve_ms)s
  RETURNING day_usage.id),
t AS (
  INSERT INTO scheduling_taskrun (account_id, job, queue, ref, worker, started_at)
  SELECT %(run_account_id)s, %(run_job)s, %(run_queue)s, %(run_ref)s, %(run_worker)s, %(run_started_at)s
    FROM u RETURNING id),
k AS (
  UPDATE budgets_reservation SET status = 'active', day = %(day)s, worker = %(worker)s, cpu_reserved_ms = %(reserve_ms)s,
         lease_expires_at = %(lease)s, task_run_id = (SELECT id FROM t)
   WHERE id = (SELECT own_id FROM s) AND EXISTS (SELECT 1 FROM u)
  RETURNING id, task_run_id)
SELECT EXISTS (SELECT 1 FROM b) AS fresh, (SELECT id FROM k) AS slot_id, (SELECT task_run_id FROM k) AS task_run_id,
       EXISTS (SELECT 1 FROM fairshare_pauses(%(account_id)s, %(queue)s)) AS paused;

-- name: activate
-- DISPATCHED (its own, %(own)s) or (none) -> ACTIVE under the lock, which read the standing: CPU
-- reserved (`u`), the run inserted (`t`, %(insert_run)s) or given (%(run_id)s), the slot made
-- ACTIVE (`o`) or inserted (`n`). Unasked clauses are one-time filters. Rows by key.
WITH u AS (UPDATE budgets_usageday SET cpu_reserved_ms = cpu_reserved_ms + %(reserve_ms)s WHERE id = %(usage_id)s),
t AS (
  INSERT INTO scheduling_taskrun (account_id, job, queue, ref, worker, started_at)
  SELECT %(run_account_id)s, %(run_job)s, %(run_queue)s, %(run_ref)s, %(run_worker)s, %(run_started_at)s
   WHERE %(insert_run)s
  RETURNING id),
o AS (
  UPDATE budgets_reservation SET status = 'active', day = %(day)s, worker = %(worker)s, cpu_reserved_ms = %(reserve_ms)s,
         lease_expires_at = %(lease)s, task_run_id = COALESCE((SELECT id FROM t), %(run_id)s)
   WHERE id = %(own)s
  RETURNING id, task_run_id),
n AS (
  INSERT INTO budgets_reservation (account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker,
                                   cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms, task_run_id)
  SELECT %(account_id)s, %(queue)s, %(day)s, %(job)s, %(ref)s, 'active', %(lease)s, %(created_at)s, %(worker)s,
         %(reserve_ms)s, 0, 0, COALESCE((SELECT id FROM t), %(run_id)s)
   WHERE %(own)s::bigint IS NULL
  RETURNING id, task_run_id)
SELECT id, task_run_id FROM o UNION ALL SELECT id, task_run_id FROM n;

-- name: claim
-- (a held job) -> ACTIVE on the claim's lease, under the lock, which found it may start: the
-- line's first claimable job (`c`, fairshare_claimable: two claimants never take the same
-- job nor wait for each other), unless (%(yield_to_broker)s) a broker job waits; its run (`t`) and
-- reservation (`u`). Reads the line's first unclaimed rows (index deferred_line), a slot probe for
-- an expired claim, the queue's slots in the broker window.
WITH c AS (
  UPDATE scheduling_deferredtask SET claimed_by = %(worker)s, claim_expires_at = %(claim_expires_at)s
   WHERE id = (
     SELECT f.id FROM fairshare_claimable(%(account_id)s, %(queue)s, %(now)s, 1) f
      WHERE NOT (%(yield_to_broker)s
                 AND (SELECT waiting FROM fairshare_broker_waiting(%(queue)s, %(broker_since)s, %(broker_forgets)s))))
  RETURNING job, ref, priority),
t AS (
  INSERT INTO scheduling_taskrun (account_id, job, queue, ref, worker, started_at)
  SELECT %(account_id)s, c.job, %(queue)s, c.ref, %(worker)s, %(run_started_at)s
    FROM c
  RETURNING id),
u AS (
  UPDATE budgets_usageday SET cpu_reserved_ms = cpu_reserved_ms + %(reserve_ms)s
   WHERE id = %(usage_id)s AND EXISTS (SELECT 1 FROM c))
INSERT INTO budgets_reservation (account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker,
                                 cpu_reserved_ms, cpu_reported_ms, cpu_charged_ms, task_run_id)
SELECT %(account_id)s, %(queue)s, %(day)s, c.job, c.ref, 'active', %(slot_lease)s, %(created_at)s, %(worker)s,
       %(reserve_ms)s, 0, 0, (SELECT id FROM t)
  FROM c
RETURNING job, ref, id, task_run_id, (SELECT priority FROM c) AS priority;

-- name: release
-- (held jobs) -> DISPATCHED, under the lock, which saw %(limit)s may go: the line's first claimable
-- jobs (`f`, fairshare_claimable as `claim` takes them; once: a subquery that a plan re-scans
-- would skip the rows deleted and take more) out of the holding area (`h`), each with a dispatched
-- slot (`d`); the caller sends them once it commits, in line order. Reads the line's first rows
-- (index deferred_line), for each whose claim expired one probe of its slots.
WITH f AS MATERIALIZED (SELECT id FROM fairshare_claimable(%(account_id)s, %(queue)s, %(now)s, %(limit)s)),
h AS (
  DELETE FROM scheduling_deferredtask t USING f WHERE t.id = f.id
  RETURNING t.id, job, ref, priority, in_line_since, message),
d AS (
  INSERT INTO budgets_reservation (account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker,
                                   cpu_reserved_ms)
  SELECT %(account_id)s, %(queue)s, %(day)s, job, ref, 'dispatched', %(lease)s, %(created_at)s, '', 0 FROM h)
SELECT job, ref, priority, message::text AS message FROM h ORDER BY priority DESC, in_line_since, id;

-- name: start_admitted
-- ACTIVE on a claim's lease -> ACTIVE (running): the claim completes while the slot is there,
-- locked (not written) so that a reclaim at the same moment goes first or finds it started. By key.
WITH s AS (SELECT id FROM budgets_reservation WHERE id = %(slot_id)s AND status = 'active' FOR NO KEY UPDATE)
DELETE FROM scheduling_deferredtask
 WHERE job = %(job)s AND ref = %(ref)s AND claimed_by = %(worker)s AND EXISTS (SELECT 1 FROM s)
RETURNING 1 AS started;

-- name: reserve_more
-- ACTIVE -> ACTIVE, %(ms)s more reserved: unless %(checked)s (the lock saw it), only when the
-- account has that much unreserved on the usage row's latest version. Rows by key.
WITH u AS (
  UPDATE budgets_usageday u SET cpu_reserved_ms = u.cpu_reserved_ms + %(ms)s FROM budgets_budget b
   WHERE u.id = %(usage_id)s AND b.account_id = u.account_id AND b.queue = u.queue
     AND (%(checked)s OR fairshare_unreserved(b.cpu_seconds_per_day, u.cpu_used_ms, u.cpu_reserved_ms) >= %(ms)s)
  RETURNING 1)
UPDATE budgets_reservation SET cpu_reserved_ms = cpu_reserved_ms + %(ms)s
 WHERE id = %(slot_id)s AND EXISTS (SELECT 1 FROM u)
RETURNING 1 AS reserved;

-- name: grow
-- ACTIVE -> ACTIVE: the run reports its CPU, renews its lease and reserves %(ms)s more (the lock
-- saw the account has it); no row when the slot is no longer ACTIVE. Rows by key.
WITH s AS (
  UPDATE budgets_reservation SET cpu_reported_ms = %(cpu_ms)s, lease_expires_at = %(lease)s,
         cpu_reserved_ms = cpu_reserved_ms + %(ms)s
   WHERE id = %(slot_id)s AND status = 'active' RETURNING id),
u AS (
  UPDATE budgets_usageday SET cpu_reserved_ms = cpu_reserved_ms + %(ms)s
   WHERE id = %(usage_id)s AND %(ms)s > 0 AND EXISTS (SELECT 1 FROM s))
SELECT id AS grown FROM s;

-- name: unadmit
-- ACTIVE on a claim's lease -> (none), never started (with %(expired_before)s: only if its lease
-- is still expired then): its CPU unreserved; what it carried charged. Rows by key.
WITH r AS (
  DELETE FROM budgets_reservation
   WHERE id = %(slot_id)s AND status = 'active'
     AND (%(expired_before)s::timestamptz IS NULL OR lease_expires_at < %(expired_before)s)
  RETURNING *),
c AS (
  UPDATE budgets_usageday u
     SET cpu_used_ms = u.cpu_used_ms + r.carried_cpu_ms,
         cpu_reserved_ms = u.cpu_reserved_ms - r.cpu_reserved_ms - r.carried_cpu_ms, runs = u.runs + r.carried_runs,
         wall_ms = u.wall_ms + r.carried_wall_ms, db_wait_ms = u.db_wait_ms + r.carried_db_wait_ms,
         storage_wait_ms = u.storage_wait_ms + r.carried_storage_wait_ms
    FROM r WHERE u.account_id = r.account_id AND u.queue = r.queue AND u.day = r.day)
SELECT task_run_id FROM r;

-- name: reclaim
-- ACTIVE -> RECLAIMED: a run whose lease expired is charged %(charge_ms)s (what it reported) and
-- counted, its reservation and what it carried given back; the slot keeps what was charged. Under
-- the lock, the slot locked by the caller. Rows by key.
WITH r AS (
  UPDATE budgets_reservation n
     SET status = 'reclaimed', cpu_charged_ms = %(charge_ms)s, carried_runs = 0, carried_cpu_ms = 0,
         carried_wall_ms = 0, carried_db_wait_ms = 0, carried_storage_wait_ms = 0, carried_since = NULL
    FROM budgets_reservation o
   WHERE n.id = %(slot_id)s AND o.id = n.id
  RETURNING o.*)
UPDATE budgets_usageday u
   SET cpu_used_ms = u.cpu_used_ms + %(charge_ms)s + r.carried_cpu_ms,
       cpu_reserved_ms = u.cpu_reserved_ms - r.cpu_reserved_ms - r.carried_cpu_ms,
       runs = u.runs + 1 + r.carried_runs, wall_ms = u.wall_ms + r.carried_wall_ms,
       db_wait_ms = u.db_wait_ms + r.carried_db_wait_ms, storage_wait_ms = u.storage_wait_ms + r.carried_storage_wait_ms
  FROM r WHERE u.account_id = r.account_id AND u.queue = r.queue AND u.day = r.day
RETURNING 1 AS charged;

-- name: revive
-- RECLAIMED -> ACTIVE: a frozen run woke to a free slot (the lock saw it): %(reserve_ms)s
-- reserved, counted once, no longer lost; what the reclaim charged stays. Rows by key.
WITH s AS (
  UPDATE budgets_reservation SET status = 'active', cpu_reserved_ms = %(reserve_ms)s, lease_expires_at = %(lease)s
   WHERE id = %(slot_id)s AND status = 'reclaimed'
  RETURNING account_id, queue, day, task_run_id, cpu_charged_ms),
u AS (
  UPDATE budgets_usageday u SET runs = u.runs - 1, cpu_reserved_ms = u.cpu_reserved_ms + %(reserve_ms)s
    FROM s WHERE u.account_id = s.account_id AND u.queue = s.queue AND u.day = s.day),
t AS (
  UPDATE scheduling_taskrun t SET outcome = 'running', finished_at = NULL, error_class = '', error_message = ''
    FROM s WHERE t.id = s.task_run_id AND t.outcome = 'lost')
SELECT cpu_charged_ms FROM s;

-- name: broker_waiting
-- Whether a job sent to the broker on the queue waits for a worker: the queue's slots sent in the
-- broker window (index reservation_age).
SELECT waiting FROM fairshare_broker_waiting(%(queue)s, %(broker_since)s, %(broker_forgets)s);

-- name: idle_workers
-- How many more jobs the queue's workers could start now: its live heartbeats less its slots
-- taken (fairshare_idle_workers, by index: bounded by workers and slots, never by history).
SELECT idle FROM fairshare_idle_workers(%(queue)s, %(live_since)s);

-- name: ready_accounts
-- Accounts whose line on the queue could go now with a free slot, in fair order: fewest slots for
-- their weight, then the longest-waiting first job. Reads the ready Backlog rows (index
-- backlog_ready), their Budget, slots and first held job: O(accounts that could run). An account
-- with no Budget row yet counts as one free slot of weight 1 (its row is made under the lock).
SELECT c.account_id, c.taken::float / c.weight AS share FROM (
  SELECT k.account_id, k.head_since, COALESCE(b.max_concurrent, 1) AS max_concurrent,
         COALESCE(b.weight, 1) AS weight, s.taken
    FROM fairshare_ready_accounts(%(queue)s) k
    LEFT JOIN budgets_budget b ON b.account_id = k.account_id AND b.queue = %(queue)s
   CROSS JOIN LATERAL fairshare_taken(k.account_id, %(queue)s) s) c
 WHERE c.taken < c.max_concurrent
 ORDER BY c.taken::float / c.weight, c.head_since
 LIMIT %(limit)s;

-- name: settle
-- ACTIVE (or DISPATCHED, RECLAIMED) -> (none), no lock (it only frees): the slot deleted (`r`:
-- exactly once), its figures charged to its day (`c`), its run's end recorded (`t`), its usage
-- event written where usage_events_on() (`e`, docs/usage-log.md). With %(pass_on)s the slot goes
-- on to the line's first job (`h`, as in `claim`) when the run is of today, left at least half a
-- step and fairshare_may_pass_on lets it: a new ACTIVE slot (`n`) with what the run left (at most
-- a step), its run (`s`); `c` gives back only the rest. Carried charges (`k`): a pass-on that gives
-- nothing back and hit no cap writes no usage row; the new slot carries the figures (for at most
-- CHARGE_CARRY_S) and its end charges them, their CPU reserved meanwhile: used + reserved stays
-- exact. Its line, any line and others' turn are read only when not passed on. Reads the slot,
-- usage and Backlog rows by key; passing on, as `claim`.
WITH r AS (
  DELETE FROM budgets_reservation WHERE id = %(slot_id)s
  RETURNING *, (status = 'active')::int AS ran, cpu_reserved_ms - %(cpu_ms)s AS left_ms),
h AS (
  UPDATE scheduling_deferredtask SET claimed_by = %(worker)s, claim_expires_at = %(claim_expires_at)s
   WHERE id = (
     SELECT f.id FROM fairshare_claimable(%(account_id)s, %(queue)s, %(now)s, 1) f
      WHERE %(pass_on)s
        AND EXISTS (SELECT 1 FROM r WHERE r.ran = 1 AND r.day = %(today)s AND r.cpu_charged_ms = 0
                       AND r.left_ms >= %(keep_at_least)s
                       AND (SELECT may FROM fairshare_may_pass_on(%(account_id)s, %(queue)s, r.id, %(broker_since)s,
                                                                  %(broker_forgets)s))))
  RETURNING job, ref, priority),
k AS (
  SELECT (p.passed AND %(carry)s AND %(cap_hits)s = 0 AND r.left_ms <= %(step_ms)s
          AND COALESCE(r.carried_since, %(created_at)s) > %(carry_since)s)::int AS carry, p.passed::int AS passed
    FROM r, (SELECT EXISTS (SELECT 1 FROM h) AS passed) p),
c AS (
  UPDATE budgets_usageday AS u
     SET cpu_used_ms = u.cpu_used_ms + GREATEST(%(cpu_ms)s - r.cpu_charged_ms, 0) + r.carried_cpu_ms,
         cpu_reserved_ms = u.cpu_reserved_ms - r.ran * r.cpu_reserved_ms - r.carried_cpu_ms
                           + k.passed * LEAST(r.left_ms, %(step_ms)s),
         runs = u.runs + r.ran + r.carried_runs,
         wall_ms = u.wall_ms + %(wall_ms)s + r.carried_wall_ms,
         db_wait_ms = u.db_wait_ms + %(db_wait_ms)s + r.carried_db_wait_ms,
         storage_wait_ms = u.storage_wait_ms + %(storage_wait_ms)s + r.carried_storage_wait_ms,
         cap_hits = u.cap_hits + %(cap_hits)s
    FROM r, k WHERE k.carry = 0 AND u.account_id = %(account_id)s AND u.queue = %(queue)s AND u.day = r.day
  RETURNING u.id),
t AS (
  UPDATE scheduling_taskrun
     SET finished_at = %(finished_at)s, cpu_ms = %(cpu_ms)s, wall_ms = %(wall_ms)s, db_wait_ms = %(db_wait_ms)s,
         storage_wait_ms = %(storage_wait_ms)s, peak_rss_kb = %(peak_rss_kb)s,
         outcome = COALESCE(%(outcome)s, outcome), items = COALESCE(%(items)s, items),
         error_class = COALESCE(%(error_class)s, error_class), error_message = COALESCE(%(error_message)s, error_message)
   WHERE id = (SELECT task_run_id FROM r)
  RETURNING *),
e AS (
  INSERT INTO usage_usageevent (kind, account_id, queue, day, charged_runs, charged_cpu_ms, run_id, job, ref, outcome,
                                started_at, finished_at, cpu_ms, wall_ms, db_wait_ms, storage_wait_ms, items)
  SELECT 'settled', r.account_id, r.queue, r.day, r.ran, GREATEST(t.cpu_ms - r.cpu_charged_ms, 0), t.id, t.job, t.ref,
         t.outcome, t.started_at, t.finished_at, t.cpu_ms, t.wall_ms, t.db_wait_ms, t.storage_wait_ms, t.items
    FROM r, t WHERE usage_events_on()),
s AS (
  INSERT INTO scheduling_taskrun (account_id, job, queue, ref, worker, started_at)
  SELECT %(account_id)s, h.job, %(queue)s, h.ref, %(worker)s, %(run_started_at)s FROM h RETURNING id),
n AS (
  INSERT INTO budgets_reservation (account_id, queue, day, job, ref, status, lease_expires_at, created_at, worker,
                                   cpu_reserved_ms, task_run_id, carried_runs, carried_cpu_ms, carried_wall_ms,
                                   carried_db_wait_ms, carried_storage_wait_ms, carried_since)
  SELECT %(account_id)s, %(queue)s, r.day, h.job, h.ref, 'active', %(slot_lease)s, %(created_at)s, %(worker)s,
         LEAST(r.left_ms, %(step_ms)s), (SELECT id FROM s),
         k.carry * (r.carried_runs + 1), k.carry * (r.carried_cpu_ms + %(cpu_ms)s),
         k.carry * (r.carried_wall_ms + %(wall_ms)s), k.carry * (r.carried_db_wait_ms + %(db_wait_ms)s),
         k.carry * (r.carried_storage_wait_ms + %(storage_wait_ms)s),
         CASE WHEN k.carry = 1 THEN COALESCE(r.carried_since, %(created_at)s) END
    FROM h, r, k
  RETURNING job AS passed_job, ref AS passed_ref, id AS passed_slot_id, task_run_id AS passed_run_id,
            cpu_reserved_ms AS passed_reserved_ms)
SELECT r.task_run_id, r.status, n.*, (SELECT priority FROM h) AS passed_priority,
       n IS NULL AND (SELECT in_line FROM fairshare_in_line(%(account_id)s, %(queue)s)) AS in_line,
       n IS NULL AND (SELECT waiting FROM fairshare_any_ready(%(queue)s)) AS waiting,
       n IS NULL AND (SELECT others_waiting FROM fairshare_others_ready(%(account_id)s, %(queue)s)) AS others_waiting,
       COALESCE((SELECT id FROM c), (SELECT x.id FROM budgets_usageday x
                                      WHERE x.account_id = %(account_id)s AND x.queue = %(queue)s AND x.day = r.day))
         AS usage_id
  FROM r LEFT JOIN n ON TRUE;
