package ops

import (
	"fmt"
	"strings"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
)

// Grants is the least-privilege recipe for the role `walbox run` connects
// as: SQL for a DBA to review and run, with the reasons as comments.
func Grants(cfg config.Config, role string) string {
	if role == "" {
		role = "walbox"
	}
	var all []cdc.TableName
	if ts, err := cfg.Tables(); err == nil {
		for _, x := range ts {
			all = append(all, x.Name)
		}
	}
	if len(all) == 0 {
		all = []cdc.TableName{{Schema: "public", Name: "outbox_events"}}
	}
	t := all[0]
	r := cdc.QuoteIdent(role)
	var b strings.Builder
	p := func(format string, args ...any) { fmt.Fprintf(&b, format+"\n", args...) }
	p("-- walbox: a least-privilege role for `walbox run` (outbox table %s).", t)
	p("-- Run as a superuser (REPLICATION can only be granted by one) in the outbox's database,")
	p("-- after `walbox migrate` (which runs as the table owner: creating the publication needs")
	p("-- ownership of the table). Then `walbox run` connects as %s, with postgres.create_publication: false.", role)
	p("")
	p("-- The role: LOGIN, and REPLICATION for the logical replication slot.")
	p("CREATE ROLE %s LOGIN REPLICATION PASSWORD 'change-me';  -- or \\password %s in psql", r, role)
	p("DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %%I TO %%I', current_database(), %s); END $$;", cdc.QuoteLiteral(role))
	p("")
	p("-- Read the outbox: the snapshot backfill of a new slot and `walbox replay` SELECT from it.")
	for i, t := range all {
		if i == 0 || t.Schema != all[i-1].Schema {
			p("GRANT USAGE ON SCHEMA %s TO %s;", cdc.QuoteIdent(t.Schema), r)
		}
		p("GRANT SELECT ON %s TO %s;", t.Quoted(), r)
	}
	p("-- The sweeper marks rows after the JetStream ack (sweeper.mark_processed: true).")
	p("-- Leave out columns your table does not have (e.g. attempts in the DAARION layout).")
	for _, t := range all {
		p("GRANT UPDATE (processed, processed_at, error, attempts) ON %s TO %s;", t.Quoted(), r)
	}
	p("")
	p("-- walbox's own schema: the leader writes its lag to walbox.relay_status every second.")
	p("GRANT USAGE ON SCHEMA walbox TO %s;", r)
	p("GRANT SELECT, INSERT, UPDATE ON walbox.relay_status TO %s;", r)
	p("-- A snapshot backfill in progress is recorded in walbox.slot_backfill (so a crash mid-backfill is redone).")
	p("GRANT SELECT, INSERT, UPDATE, DELETE ON walbox.slot_backfill TO %s;", r)
	p("")
	p("-- Partition upkeep and archival (the sweeper, at start and every 10 minutes) create partitions")
	p("-- of the outbox, move rows out of its default partition and old partitions into")
	p("-- %s: that needs ownership of the table and CREATE on schema walbox.", ArchiveTable(t))
	p("-- Without them events still flow and rows are still marked; the upkeep fails, is logged")
	p("-- as a warning and retried with back-off. Either grant them:")
	p("--   GRANT <owner of %s> TO %s;  -- membership in the owning role", t, r)
	p("--   GRANT CREATE ON SCHEMA walbox TO %s;", r)
	p("-- or set archive.after: 0 and keep partitions from your own job, as the owner:")
	p("--   SELECT walbox.ensure_partitions('%s'::regclass);", t)
	p("")
	p("-- pg_hba.conf: walbox's normal connections and its logical replication connection")
	p("-- (replication=database) are both matched by the database name; the keyword")
	p("-- 'replication' matches physical replication only. One line covers both:")
	p("--   hostssl <database>  %s  10.0.0.0/24  scram-sha-256", role)
	p("-- then SELECT pg_reload_conf(); and check everything with: walbox doctor")
	return b.String()
}
