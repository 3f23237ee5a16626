-- The default outbox table: a superset of the common outbox layouts,
-- partitioned by created_at. An existing table of this name is left as it is
-- (walbox reads columns by role, mapped in outbox.columns).
CREATE TABLE IF NOT EXISTS {{.Table}} (
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
    created_at     timestamptz NOT NULL DEFAULT now(),
    topic          text        NOT NULL,
    stream         text,
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    partition_key  text,
    payload        jsonb       NOT NULL,
    headers        jsonb,
    processed      boolean     NOT NULL DEFAULT false,
    processed_at   timestamptz,
    attempts       int         NOT NULL DEFAULT 0,
    error          text,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

-- No default partition: PostgreSQL refuses DETACH PARTITION ... CONCURRENTLY
-- next to one, and without it archival would lock out every INSERT. An
-- insert always finds its partition as long as the sweeper (or a DBA's job
-- calling walbox.ensure_partitions) keeps partitions ahead; an older walbox's
-- <table>_default is emptied and removed by the sweeper (docs/sweeper.md).
SELECT walbox.ensure_partitions({{.TableLiteral}}::regclass, 7, 'day');

-- Unprocessed rows are what the sweeper, status, the metrics and a
-- re-backfill look for. walbox's queries say `NOT processed` on a NOT NULL
-- column and `processed IS NOT TRUE` on a nullable one (cdc.Unprocessed),
-- and the planner uses a partial index only for the predicate written the
-- same way, so the index takes the form the queries use. An existing table
-- of another layout (no created_at or processed column) gets no such index:
-- the DBA indexes it as its layout needs (docs/sweeper.md, Indexes).
DO $$
DECLARE
    not_null boolean;
BEGIN
    SELECT attnotnull INTO not_null FROM pg_attribute
     WHERE attrelid = {{.TableLiteral}}::regclass AND attname = 'processed' AND NOT attisdropped;
    IF not_null IS NOT NULL AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = {{.TableLiteral}}::regclass
          AND attname = 'created_at' AND NOT attisdropped) THEN
        EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON %I.%I (created_at) WHERE %s',
                       {{.UnprocessedIndexNameLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}},
                       CASE WHEN not_null THEN 'NOT processed' ELSE 'processed IS NOT TRUE' END);
    END IF;
END $$;
