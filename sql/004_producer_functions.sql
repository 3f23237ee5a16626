-- walbox: every time (the functions follow the configured outbox tables)
-- Producer functions: write an event from SQL (a trigger, a stored
-- procedure, psql, a service in any language) inside the caller's
-- transaction. Both return the event id, a UUIDv7 (time-ordered).
--
-- They are plpgsql so that creating them does not depend on the outbox
-- table's layout: walbox.emit needs the default layout's columns (id, topic,
-- payload, event_type, aggregate_type, aggregate_id, partition_key, headers)
-- only when it is called. Both run with the caller's rights (SECURITY
-- INVOKER): emit needs INSERT on the outbox table; emit_message needs EXECUTE
-- on pg_logical_emit_message (granted to PUBLIC by default).
--
-- The functions live in schema walbox, one set per database. With several
-- outbox tables (outboxes in walbox.yaml) the last argument, outbox, names
-- the table (schema.table; public when no schema is given); without it they
-- write to the default table. Each table's own column names are used.

{{/* Both functions have the same arguments and check them alike: the
templates "signature" and "argument checks" write that part of each, given
the function's name (without schema walbox). They print nothing here. */ -}}
{{define "signature" -}}
DROP FUNCTION IF EXISTS walbox.{{.}}(text, jsonb, text, text, text, jsonb, text);
CREATE OR REPLACE FUNCTION walbox.{{.}}(
    topic          text,
    payload        jsonb,
    event_type     text  DEFAULT NULL,
    aggregate_type text  DEFAULT NULL,
    aggregate_id   text  DEFAULT NULL,
    headers        jsonb DEFAULT NULL,
    partition_key  text  DEFAULT NULL,
    outbox         text  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    new_id uuid := walbox.uuid_v7();
{{- end -}}
{{define "argument checks"}}    IF {{.}}.topic IS NULL OR btrim({{.}}.topic) = '' THEN
        RAISE EXCEPTION 'walbox.{{.}}: topic must not be NULL or empty' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF {{.}}.payload IS NULL THEN
        RAISE EXCEPTION 'walbox.{{.}}: payload must not be NULL (use ''{}'' for an empty one)' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF {{.}}.headers IS NOT NULL AND jsonb_typeof({{.}}.headers) <> 'object' THEN
        RAISE EXCEPTION 'walbox.{{.}}: headers must be a JSON object, not %', jsonb_typeof({{.}}.headers) USING ERRCODE = 'invalid_parameter_value';
    END IF;
{{- end -}}
-- walbox.uuid_v7 returns a version 7 UUID: 48 bits of Unix time in
-- milliseconds, then random bits, so ids sort by creation time (like
-- outbox.Write's ids). PostgreSQL 18 has uuidv7() built in; this works on 13+.
CREATE OR REPLACE FUNCTION walbox.uuid_v7() RETURNS uuid
LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
    SELECT encode(
        set_bit(set_bit(
            overlay(uuid_send(gen_random_uuid())
                    PLACING substring(int8send((extract(epoch FROM clock_timestamp()) * 1000)::bigint) FROM 3)
                    FROM 1 FOR 6),
            52, 1), 53, 1),
        'hex')::uuid
$$;

-- walbox.emit inserts one event into the outbox table and returns its id.
-- partition_key defaults to aggregate_id. headers is a JSON object; each key
-- becomes a message header (e.g. traceparent).
--
--   SELECT walbox.emit('user.created', '{"user_id": "42"}',
--                      event_type => 'user.created', aggregate_type => 'user', aggregate_id => '42');
--   SELECT walbox.emit('invoice.paid', '{"id": 7}', outbox => 'billing.outbox');
-- (Before outbox was added, the functions had seven arguments: that
-- version is dropped, so a call without outbox is not ambiguous.)
{{template "signature" "emit"}}
    target text := coalesce(emit.outbox, {{.EmitDefaultLiteral}});
BEGIN
{{template "argument checks" "emit"}}
    IF position('.' IN target) = 0 THEN
        target := 'public.' || target;
    END IF;
{{.EmitInserts}}
    RETURN new_id;
END $$;

-- walbox.emit_message writes one event into the WAL only (table-less mode):
-- pg_logical_emit_message(true, 'walbox', <body>) inside the caller's
-- transaction, so it is decoded if and only if the transaction commits.
-- Nothing is stored, so there is nothing to sweep; the trade-off is that after
-- a lost slot these events cannot be republished from a table.
--
-- The message prefix is 'walbox'; the body is one JSON object, which the
-- relay decodes (keys always present, in this order; null where not given):
--
--   {
--     "id":             "0190f5c2-...",            -- uuid text, a UUIDv7; becomes Nats-Msg-Id
--     "topic":          "user.created",            -- string; the subject (after the relay's prefix)
--     "payload":        {...},                     -- any JSON value (the payload argument, as JSON, not a string)
--     "event_type":     "user.created" | null,
--     "aggregate_type": "user" | null,
--     "aggregate_id":   "42" | null,
--     "partition_key":  "42" | null,               -- defaults to aggregate_id
--     "headers":        {"traceparent": "..."} | null,  -- JSON object: each key a message header
--     "created_at":     "2025-01-02T03:04:05.123456+00:00", -- now() (transaction start), ISO 8601 with offset
--     "table":          "billing.outbox" | null     -- whose routing applies; null: the default table
--   }
{{template "signature" "emit_message"}}
BEGIN
{{template "argument checks" "emit_message"}}
    PERFORM pg_logical_emit_message(true, 'walbox', json_build_object(
        'id',             new_id,
        'topic',          emit_message.topic,
        'payload',        emit_message.payload,
        'event_type',     emit_message.event_type,
        'aggregate_type', emit_message.aggregate_type,
        'aggregate_id',   emit_message.aggregate_id,
        'partition_key',  coalesce(emit_message.partition_key, emit_message.aggregate_id),
        'headers',        emit_message.headers,
        'created_at',     now(),
        'table',          emit_message.outbox
    )::text);
    RETURN new_id;
END $$;
