-- The relay's and the monitoring's statements on the outbox (usage_usageevent), kept whole and
-- loaded once (scheduling.db.load_queries). None grows with what the outbox holds: each reads the
-- primary key's index from its low end (tests/usage EXPLAIN them on a large outbox).

-- name: oldest
-- The oldest rows, by id (the primary key's index, read no further than the batch), each as the
-- JSON the log keeps: an export's body as stored; a run's rendered here from its figures, the one
-- place of the format of docs/usage-log.md (built for a batch here, about 13 us an event, where
-- the settling transaction would pay several times that). Sent as text: no parse and dump per event.
SELECT id, event_id::text AS event_id, COALESCE(subject, 'run.' || queue || '.' || account_id) AS subject,
       COALESCE(body::text, json_build_object(
         'v', 1, 'id', event_id, 'type', CASE kind WHEN 'revived' THEN 'run.revived' ELSE 'run.settled' END,
         'at', created_at, 'account', account_id, 'queue', queue, 'day', day, 'run', run_id, 'job', job, 'ref', ref,
         'outcome', CASE kind WHEN 'settled' THEN NULLIF(outcome, 'running') ELSE outcome END,
         'started_at', started_at, 'finished_at', finished_at, 'cpu_ms', cpu_ms, 'wall_ms', wall_ms,
         'db_wait_ms', db_wait_ms, 'storage_wait_ms', storage_wait_ms, 'items', items,
         -- A settlement charges the run's wall time and waits; a reclaim and a revival none.
         'charged', json_build_object('runs', charged_runs, 'cpu_ms', charged_cpu_ms,
           'wall_ms', CASE kind WHEN 'settled' THEN COALESCE(wall_ms, 0) ELSE 0 END,
           'db_wait_ms', CASE kind WHEN 'settled' THEN COALESCE(db_wait_ms, 0) ELSE 0 END,
           'storage_wait_ms', CASE kind WHEN 'settled' THEN COALESCE(storage_wait_ms, 0) ELSE 0 END))::text) AS body
  FROM usage_usageevent
 ORDER BY id
 LIMIT %(batch)s;

-- name: delete
-- What the log acknowledged, by primary key.
DELETE FROM usage_usageevent WHERE id = ANY(%(ids)s);

-- name: lag
-- The outbox's extent and its oldest row: three probes of the primary key's index, whatever the
-- outbox holds (a count would read every row, and the outbox grows while the log is down). The
-- relay deletes in id order, so the span is the count but for ids of rolled-back transactions.
SELECT COALESCE(max(id) - min(id) + 1, 0) AS events,
       COALESCE(EXTRACT(EPOCH FROM now() - (SELECT created_at FROM usage_usageevent ORDER BY id LIMIT 1)), 0) AS seconds
  FROM usage_usageevent;
