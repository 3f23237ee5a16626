-- Inserts only; rows of every partition published under the root table's
-- name, which is what walbox's column mapping looks up.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{.PublicationLiteral}}) THEN
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE %I.%I WITH (publish = %L, publish_via_partition_root = true)',
                       {{.PublicationLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}}, 'insert');
    END IF;
END $$;
