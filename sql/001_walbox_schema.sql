-- walbox's own objects live in schema walbox.
CREATE SCHEMA IF NOT EXISTS walbox;

-- Lag figures the relay writes every second: for producer back-pressure
-- (outbox.Lag) and for humans.
CREATE TABLE IF NOT EXISTS walbox.relay_status (
    slot_name         text PRIMARY KEY,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    leader            text,
    confirmed_lsn     pg_lsn,
    lag_bytes         bigint,
    lag_seconds       double precision,
    events_per_second double precision
);

-- Consumer-side idempotency records (package consumer).
CREATE TABLE IF NOT EXISTS walbox.processed_events (
    consumer_group text NOT NULL,
    event_id       text NOT NULL,
    processed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, event_id)
);

-- ensure_partitions keeps range partitions of a table partitioned by
-- created_at created ahead, so an insert always finds its partition. One
-- partition per day (or month) from yesterday to days_ahead days from now.
-- Existing partitions are left alone.
--
-- Each partition is created as a plain table and then attached: CREATE TABLE
-- ... PARTITION OF takes ACCESS EXCLUSIVE on the outbox, which queues behind
-- any reader (a pg_dump, a report, a backfill) while every producer's INSERT
-- queues behind it; ATTACH PARTITION takes SHARE UPDATE EXCLUSIVE, which
-- neither readers nor INSERTs conflict with. Next to a default partition
-- ATTACH also takes ACCESS EXCLUSIVE on the default (to check that none of its
-- rows belong to the new range): INSERTs routed to other partitions do not
-- wait for it. Call it under a short lock_timeout (the sweeper does): a range
-- that cannot be locked now is created by a later call. A range that
-- collides with rows already in a default partition is reported and skipped.
CREATE OR REPLACE FUNCTION walbox.ensure_partitions(tbl regclass, days_ahead int DEFAULT 7, step text DEFAULT 'day')
RETURNS int LANGUAGE plpgsql AS $$
DECLARE
    nsp text; rel text; d date; upper date; part text; created int := 0;
BEGIN
    IF step NOT IN ('day', 'month') THEN
        RAISE EXCEPTION 'walbox.ensure_partitions: step must be day or month, not %', step;
    END IF;
    SELECT n.nspname, c.relname INTO nsp, rel
      FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
     WHERE c.oid = tbl AND c.relkind = 'p';
    IF NOT FOUND THEN
        RETURN 0; -- not partitioned: nothing to do
    END IF;
    d := date_trunc(step, now() - interval '1 day')::date;
    WHILE d <= (now() + make_interval(days => days_ahead))::date LOOP
        upper := (d + ('1 ' || step)::interval)::date;
        part := rel || '_p' || to_char(d, CASE step WHEN 'day' THEN 'YYYYMMDD' ELSE 'YYYYMM' END);
        IF to_regclass(format('%I.%I', nsp, part)) IS NULL THEN
            BEGIN
                EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED INCLUDING STORAGE)',
                               nsp, part, nsp, rel);
                EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                               nsp, rel, nsp, part, d::timestamptz, upper::timestamptz);
                created := created + 1;
            EXCEPTION WHEN check_violation OR invalid_object_definition THEN
                RAISE WARNING 'walbox: partition % not created: %', part, SQLERRM;
            END;
        END IF;
        d := upper;
    END LOOP;
    RETURN created;
END $$;
