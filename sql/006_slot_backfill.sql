-- A backfill in progress for a slot: walbox writes the row before it creates
-- the slot (with its exported snapshot) and deletes it once every backfilled
-- row is acked. A slot that exists while its row is still here was created
-- by a backfill that never finished: walbox drops and recreates it, or the
-- rows that were only in the snapshot would never be published.
CREATE TABLE IF NOT EXISTS walbox.slot_backfill (
    slot_name      text PRIMARY KEY,
    started_at     timestamptz NOT NULL DEFAULT now(),
    consistent_lsn pg_lsn
);
