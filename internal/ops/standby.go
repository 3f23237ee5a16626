package ops

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/internal/config"
)

// DoctorStandby adds the checks of a standby that walbox's slot must
// survive a promotion to (PostgreSQL 17+ failover slots): on the primary the
// slot's failover flag and synchronized_standby_slots naming the standby's
// physical slot; on the standby sync_replication_slots, hot_standby_feedback,
// primary_slot_name and a dbname in primary_conninfo; and the standby's copy
// of the slot, synced and persisted (not temporary). Until it is, a
// promotion loses the slot: that check fails.
func DoctorStandby(ctx context.Context, cfg config.Config, standbyURL string, r *DoctorReport) {
	const pre = "standby."
	sc, err := pgx.Connect(ctx, standbyURL)
	if err != nil {
		r.add(pre+"connect", Fail, fmt.Sprintf("cannot connect to the standby (%s): %v", RedactPostgresURL(standbyURL), err), "check --standby; the role needs to log in to the standby as it does to the primary")
		return
	}
	defer closePG(ctx, sc)
	var version int
	var inRecovery bool
	if err := sc.QueryRow(ctx, `SELECT current_setting('server_version_num')::int, pg_is_in_recovery()`).Scan(&version, &inRecovery); err != nil {
		r.add(pre+"connect", Fail, fmt.Sprintf("connected, but cannot query: %v", err), "")
		return
	}
	if !inRecovery {
		r.add(pre+"connect", Fail, "the server given with --standby is not in recovery: it is a primary, not a standby", "pass the URL of a standby of the configured database")
		return
	}
	r.add(pre+"connect", OK, "connected to "+RedactPostgresURL(standbyURL)+" (in recovery)", "")
	if version < 170000 {
		r.add(pre+"failover_slot", Warn, fmt.Sprintf("PostgreSQL %d has no failover slots: after a promotion walbox finds no slot, recreates it and republishes the unprocessed rows (table-less events of that moment are lost)", version/10000),
			"PostgreSQL 17 or newer for failover slots (postgres.failover_slot: true)")
		return
	}
	setting := func(c *pgx.Conn, name string) string {
		var v string
		_ = c.QueryRow(ctx, `SELECT coalesce(current_setting($1, true), '')`, name).Scan(&v)
		return v
	}
	want := func(name, got, wantV, fix string) {
		if got == wantV {
			r.add(pre+name, OK, fmt.Sprintf("%s = %s on the standby", name, got), "")
			return
		}
		r.add(pre+name, Fail, fmt.Sprintf("%s = %q on the standby, want %s", name, got, wantV), fix)
	}
	want("sync_replication_slots", setting(sc, "sync_replication_slots"), "on",
		"on the standby: ALTER SYSTEM SET sync_replication_slots = on; SELECT pg_reload_conf();")
	want("hot_standby_feedback", setting(sc, "hot_standby_feedback"), "on",
		"on the standby: ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf();")
	want("wal_level", setting(sc, "wal_level"), "logical", "on the standby: ALTER SYSTEM SET wal_level = logical; and restart it")
	physSlot := setting(sc, "primary_slot_name")
	if physSlot == "" {
		r.add(pre+"primary_slot_name", Fail, "the standby streams without a physical slot (primary_slot_name is empty): slots are synchronized only through one",
			"on the primary: SELECT pg_create_physical_replication_slot('standby1'); on the standby: ALTER SYSTEM SET primary_slot_name = 'standby1'; SELECT pg_reload_conf();")
	} else {
		r.add(pre+"primary_slot_name", OK, "primary_slot_name = "+physSlot, "")
	}
	if ci := setting(sc, "primary_conninfo"); ci != "" && !strings.Contains(ci, "dbname=") {
		r.add(pre+"primary_conninfo", Fail, "primary_conninfo names no dbname: the slot sync worker cannot connect",
			"add dbname=<the outbox database> to primary_conninfo on the standby and reload")
	} else if ci != "" {
		r.add(pre+"primary_conninfo", OK, "primary_conninfo names a dbname", "")
	}

	// The primary's side.
	pc, err := connectPG(ctx, cfg)
	if err == nil {
		defer closePG(ctx, pc)
		var failover bool
		if err := pc.QueryRow(ctx, `SELECT coalesce((to_jsonb(s)->>'failover')::bool, false) FROM pg_replication_slots s WHERE slot_name = $1`, cfg.Postgres.Slot).Scan(&failover); err != nil {
			r.add(pre+"primary_slot_failover", Fail, fmt.Sprintf("walbox's slot %s not found on the primary", cfg.Postgres.Slot),
				"start walbox with postgres.failover_slot: true (or walbox slot create --failover)")
		} else if !failover {
			r.add(pre+"primary_slot_failover", Fail, fmt.Sprintf("walbox's slot %s has failover = false: it is not synchronized to standbys", cfg.Postgres.Slot),
				fmt.Sprintf("stop walbox, walbox slot drop, then start it with postgres.failover_slot: true (or on a replication connection: ALTER_REPLICATION_SLOT %s (FAILOVER true))", cfg.Postgres.Slot))
		} else {
			r.add(pre+"primary_slot_failover", OK, "walbox's slot has failover = true", "")
		}
		sss := setting(pc, "synchronized_standby_slots")
		if physSlot != "" && !containsItem(sss, physSlot) {
			r.add(pre+"synchronized_standby_slots", Fail, fmt.Sprintf("synchronized_standby_slots = %q on the primary does not name the standby's slot %s: walbox may read changes the standby never received, and a promotion then loses them", sss, physSlot),
				fmt.Sprintf("on the primary: ALTER SYSTEM SET synchronized_standby_slots = '%s'; SELECT pg_reload_conf();", physSlot))
		} else if physSlot != "" {
			r.add(pre+"synchronized_standby_slots", OK, "synchronized_standby_slots names "+physSlot, "")
		}
	}

	// The standby's copy of walbox's slot.
	var synced, temporary bool
	err = sc.QueryRow(ctx, `SELECT coalesce((to_jsonb(s)->>'synced')::bool, false), s.temporary FROM pg_replication_slots s WHERE slot_name = $1`, cfg.Postgres.Slot).Scan(&synced, &temporary)
	switch {
	case err != nil:
		r.add(pre+"slot", Fail, fmt.Sprintf("the standby has no copy of slot %s yet: a promotion now loses it", cfg.Postgres.Slot),
			"check the settings above; the slot sync worker copies failover slots every few seconds")
	case !synced:
		r.add(pre+"slot", Fail, fmt.Sprintf("slot %s on the standby was not synced from the primary", cfg.Postgres.Slot), "drop it on the standby; the sync worker creates its own copy")
	case temporary:
		r.add(pre+"slot", Fail, fmt.Sprintf("slot %s is synced but not yet persisted (temporary): a promotion now drops it", cfg.Postgres.Slot),
			"it persists once the primary's slot has passed the standby's catalog xmin: let events flow, and on the primary run SELECT pg_log_standby_snapshot(); (the server also writes one every 15 s while the database is busy)")
	default:
		r.add(pre+"slot", OK, fmt.Sprintf("slot %s is synced and persisted on the standby: it survives a promotion", cfg.Postgres.Slot), "")
	}
}

func containsItem(list, item string) bool {
	for _, x := range strings.Split(list, ",") {
		if strings.Trim(strings.TrimSpace(x), `"`) == item {
			return true
		}
	}
	return false
}
