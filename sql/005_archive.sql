-- The sweeper's archive (relay/sweep; docs/sweeper.md). The sweeper runs this
-- same file, rendered for its table, when the objects are missing.

-- One row per partition taken out of the outbox, with the step it reached:
-- detached, archived (attached to the archive table), merged, exported
-- (in cold storage, dropped here), deleted (past the retention age).
CREATE TABLE IF NOT EXISTS walbox.archive_partitions (
    source         text        NOT NULL,
    partition_name text        NOT NULL,
    range_from     text        NOT NULL,
    range_to       text        NOT NULL,
    range_start    timestamptz,
    range_end      timestamptz,
    state          text        NOT NULL,
    rows           bigint,
    bytes          bigint,
    sha256         text,
    object         text,
    min_created_at timestamptz,
    max_created_at timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source, partition_name)
);

-- The archive table has the outbox's columns. A partitioned outbox gets a
-- partitioned archive: old partitions move by DETACH and ATTACH, no row is
-- copied. An unpartitioned outbox (e.g. the DAARION layout) gets a plain
-- table that processed rows move into in batches. It is not in the
-- publication: nothing in it is ever published.
DO $$
DECLARE
    kind "char";
    key  text;
BEGIN
    SELECT c.relkind INTO kind FROM pg_class c WHERE c.oid = to_regclass({{.TableLiteral}});
    IF kind = 'p' THEN
        SELECT a.attname INTO key
          FROM pg_partitioned_table p JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = p.partattrs[0]
         WHERE p.partrelid = to_regclass({{.TableLiteral}}) AND p.partstrat = 'r' AND p.partnatts = 1;
        IF key IS NOT NULL THEN
            EXECUTE format('CREATE TABLE IF NOT EXISTS walbox.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED) PARTITION BY RANGE (%I)',
                           {{.ArchiveNameLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}}, key);
        END IF;
    ELSIF kind = 'r' THEN
        CREATE TABLE IF NOT EXISTS {{.ArchiveTable}} (LIKE {{.Table}} INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED);
        IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass({{.TableLiteral}}) AND attname = 'created_at' AND NOT attisdropped) THEN
            CREATE INDEX IF NOT EXISTS {{.ArchiveIndex}} ON {{.ArchiveTable}} (created_at);
        END IF;
    END IF;
END $$;
