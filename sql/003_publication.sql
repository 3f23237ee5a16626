-- walbox: every time (idempotent; brings the publication to the configured table)
-- Inserts only; rows of every partition published under the root table's
-- name, which is what walbox's column mapping looks up.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = {{.PublicationLiteral}}) THEN
        EXECUTE format('CREATE PUBLICATION %I FOR TABLE %I.%I WITH (publish = %L, publish_via_partition_root = true)',
                       {{.PublicationLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}}, 'insert');
    ELSIF NOT EXISTS (SELECT 1 FROM pg_publication_tables
                      WHERE pubname = {{.PublicationLiteral}} AND schemaname = {{.SchemaLiteral}} AND tablename = {{.TableNameLiteral}}) THEN
        -- outbox.table changed, or someone took the table out: bring the
        -- publication to the configured table.
        EXECUTE format('ALTER PUBLICATION %I ADD TABLE %I.%I', {{.PublicationLiteral}}, {{.SchemaLiteral}}, {{.TableNameLiteral}});
    END IF;
END $$;
