-- The relay's and the monitoring's statements on the outbox (usage_usageevent), kept whole and
-- loaded once (scheduling.db.load_queries). None grows with what the outbox holds: each reads the
-- primary key's index from its low end (tests/usage EXPLAIN them on a large outbox).

-- name: oldest
-- The oldest rows, by id (the primary key's index, read no further than the batch). body::text is
-- the JSON as stored, sent as it is: no parse and dump per event.
SELECT id, event_id::text AS event_id, subject, body::text AS body
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
