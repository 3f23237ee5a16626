package ops

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/internal/relaytest"
)

func TestSlotCreateStatusDrop(t *testing.T) {
	e := newEnv(t)

	rep, err := SlotStatus(e.ctx, e.cfg)
	if err != nil || rep.Exists {
		t.Fatalf("before create: %+v %v", rep, err)
	}
	var out bytes.Buffer
	rep.Print(&out)
	mustContain(t, "status of a missing slot", out.String(), "does not exist")

	created, err := CreateSlot(e.ctx, e.cfg, SlotCreateOptions{})
	if err != nil || !created {
		t.Fatalf("create: %v %v", created, err)
	}
	if created, err = CreateSlot(e.ctx, e.cfg, SlotCreateOptions{}); err != nil || created {
		t.Fatalf("create again: %v %v", created, err)
	}
	if _, err := CreateSlot(e.ctx, e.cfg, SlotCreateOptions{Failover: true}); err != nil {
		t.Fatalf("create --failover of an existing slot is a no-op: %v", err)
	}

	rep, err = SlotStatus(e.ctx, e.cfg)
	if err != nil || !rep.Exists || rep.Plugin != "pgoutput" || rep.Active || rep.WALStatus == "" || rep.ConfirmedFlushLSN == "" {
		t.Fatalf("status: %+v %v", rep, err)
	}
	out.Reset()
	rep.Print(&out)
	mustContain(t, "slot status", out.String(), "pgoutput", "restart_lsn", "confirmed_flush_lsn", "retained WAL", "wal_status", "safe_wal_size", "unlimited")
	out.Reset()
	if err := rep.PrintJSON(&out); err != nil {
		t.Fatal(err)
	}
	var back SlotReport
	if err := json.Unmarshal(out.Bytes(), &back); err != nil || back.Slot != e.cfg.Postgres.Slot || back.SafeWALSize != -1 {
		t.Fatalf("JSON: %v %+v\n%s", err, back, out.String())
	}

	// Without --yes it asks; "n" keeps the slot.
	out.Reset()
	existed, err := DropSlot(e.ctx, e.cfg, SlotDropOptions{In: strings.NewReader("n\n"), Out: &out})
	if !errors.Is(err, ErrAborted) || !existed {
		t.Fatalf("drop answered n: %v %v", existed, err)
	}
	mustContain(t, "drop prompt", out.String(), "Drop replication slot", "[y/N]")
	if rep, _ := SlotStatus(e.ctx, e.cfg); !rep.Exists {
		t.Fatal("slot dropped although the answer was n")
	}
	// No stdin at all: no.
	if _, err := DropSlot(e.ctx, e.cfg, SlotDropOptions{In: strings.NewReader("")}); !errors.Is(err, ErrAborted) {
		t.Fatalf("drop without an answer: %v", err)
	}
	existed, err = DropSlot(e.ctx, e.cfg, SlotDropOptions{In: strings.NewReader("y\n"), Out: &out})
	if err != nil || !existed {
		t.Fatalf("drop answered y: %v %v", existed, err)
	}
	if rep, _ := SlotStatus(e.ctx, e.cfg); rep.Exists {
		t.Fatal("slot still exists after drop")
	}
	if existed, err = DropSlot(e.ctx, e.cfg, SlotDropOptions{Yes: true}); err != nil || existed {
		t.Fatalf("drop of a missing slot: %v %v", existed, err)
	}
}

func TestSlotCreateFailoverNeedsPG17(t *testing.T) {
	e := newEnv(t)
	ctx := testCtx(t)
	conn, err := connectPG(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	var v int
	if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&v); err != nil {
		t.Fatal(err)
	}
	closePG(ctx, conn)
	created, err := CreateSlot(ctx, e.cfg, SlotCreateOptions{Failover: true})
	if v < 170000 {
		if err == nil || !strings.Contains(err.Error(), "17") {
			t.Fatalf("--failover on PostgreSQL %d: %v %v", v, created, err)
		}
		return
	}
	if err != nil || !created {
		t.Fatalf("--failover: %v %v", created, err)
	}
	// 17's columns reach slot status: the slot is for failover, not synced
	// (this is the primary), and inactive since its creation.
	rep, err := SlotStatus(ctx, e.cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Failover || rep.Synced || rep.InactiveSince == nil || rep.InvalidationReason != "" {
		t.Fatalf("slot status on PostgreSQL %d: failover %v, synced %v, inactive since %v, invalidation %q; want a failover slot, not synced, inactive, valid",
			v, rep.Failover, rep.Synced, rep.InactiveSince, rep.InvalidationReason)
	}
	var out strings.Builder
	rep.Print(&out)
	if !strings.Contains(out.String(), "failover") || !strings.Contains(out.String(), "inactive since") {
		t.Fatalf("slot status does not show 17's columns:\n%s", out.String())
	}
}

// holdSlot streams from the slot on a replication connection, as a relay
// would, until the test ends or the server terminates it.
func holdSlot(t *testing.T, e *env) {
	t.Helper()
	ctx := testCtx(t)
	pc, err := pgconn.ParseConfig(e.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	pc.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	err = pglogrepl.StartReplication(ctx, conn, e.cfg.Postgres.Slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + e.cfg.Postgres.Publication + "'"}})
	if err != nil {
		t.Fatal(err)
	}
}

func TestSlotDropRefusesActiveSlotUnlessForce(t *testing.T) {
	e := newEnv(t)
	ctx := testCtx(t)
	if _, err := CreateSlot(ctx, e.cfg, SlotCreateOptions{}); err != nil {
		t.Fatal(err)
	}
	holdSlot(t, e)
	rep, err := SlotStatus(ctx, e.cfg)
	if err != nil || !rep.Active || rep.ActivePID == 0 {
		t.Fatalf("slot not active while streamed: %+v %v", rep, err)
	}
	var out bytes.Buffer
	rep.Print(&out)
	mustContain(t, "status of an active slot", out.String(), "walsender pid")

	_, err = DropSlot(ctx, e.cfg, SlotDropOptions{Yes: true})
	if err == nil || !strings.Contains(err.Error(), "is active") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("drop of an active slot without --force: %v", err)
	}
	if rep, _ := SlotStatus(ctx, e.cfg); !rep.Exists {
		t.Fatal("active slot dropped without --force")
	}
	existed, err := DropSlot(ctx, e.cfg, SlotDropOptions{Yes: true, Force: true})
	if err != nil || !existed {
		t.Fatalf("drop --force: %v %v", existed, err)
	}
	var n int
	if err := relaytest.Conn(t, e.dbURL).QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", e.cfg.Postgres.Slot).Scan(&n); err != nil || n != 0 {
		t.Fatalf("slot still there after drop --force: %d %v", n, err)
	}
}
