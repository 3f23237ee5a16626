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

-- The default partition catches rows outside every dated partition, so an
-- insert never fails for lack of a partition.
DO $$
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = {{.TableLiteral}}::regclass) = 'p'
       AND to_regclass({{.DefaultPartitionLiteral}}) IS NULL THEN
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I DEFAULT',
                       {{.SchemaLiteral}}, {{.DefaultPartitionNameLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}});
    END IF;
END $$;

SELECT walbox.ensure_partitions({{.TableLiteral}}::regclass, 7, 'day');

-- Unprocessed rows are what the sweeper and a re-backfill look for. An
-- existing table of another layout (no created_at or processed column) gets
-- no such index: the DBA indexes it as its layout needs.
DO $$
BEGIN
    IF (SELECT count(*) FROM pg_attribute WHERE attrelid = {{.TableLiteral}}::regclass
          AND attname IN ('created_at', 'processed') AND NOT attisdropped) = 2 THEN
        EXECUTE format('CREATE INDEX IF NOT EXISTS %I ON %I.%I (created_at) WHERE NOT processed',
                       {{.UnprocessedIndexNameLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}});
    END IF;
END $$;
