package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/internal/fault"
	"github.com/walbox/walbox/relay/busops"
)

// CheckStatus is the outcome of one doctor check.
type CheckStatus = busops.Status

// Check outcomes. Only Fail makes `walbox doctor` exit 1.
const (
	OK   = busops.OK
	Warn = busops.Warn
	Fail = busops.Fail
	Skip = busops.Skip
)

// Check is one prerequisite: what was found and, when it is not ok, the
// exact fix.
type Check struct {
	Name   string      `json:"name"`
	Status CheckStatus `json:"status"`
	Detail string      `json:"detail"`
	Fix    string      `json:"fix,omitempty"`
}

// DoctorReport is every check in order.
type DoctorReport struct {
	OK     bool    `json:"ok"` // no check failed
	Failed int     `json:"failed"`
	Warned int     `json:"warned"`
	Checks []Check `json:"checks"`
}

func (r *DoctorReport) add(name string, st CheckStatus, detail, fix string) {
	r.Checks = append(r.Checks, Check{Name: name, Status: st, Detail: detail, Fix: fix})
	switch st {
	case Fail:
		r.Failed++
	case Warn:
		r.Warned++
	}
	r.OK = r.Failed == 0
}

// Doctor checks every prerequisite of `walbox run` against the configured
// PostgreSQL and NATS (or Kafka, with sink: kafka), read-only. It returns a report even when nothing
// could be reached (the connection checks then fail and the rest skip).
func Doctor(ctx context.Context, cfg config.Config) *DoctorReport {
	r := &DoctorReport{OK: true}
	doctorPostgres(ctx, cfg, r)
	bus, err := openBus(ctx, cfg)
	if err != nil {
		busUnreachable(cfg, err, r.add)
		return r
	}
	defer bus.Close()
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	bus.Check(cctx, r.add)
	return r
}

// Print writes the report for people: one line per check, the fix under
// every one that is not ok, and a summary.
func (r *DoctorReport) Print(w io.Writer) {
	width := 0
	for _, c := range r.Checks {
		width = max(width, len(c.Name))
	}
	for _, c := range r.Checks {
		label := map[CheckStatus]string{OK: "ok", Warn: "WARN", Fail: "FAIL", Skip: "skip"}[c.Status]
		fmt.Fprintf(w, "%-4s  %-*s  %s\n", label, width, c.Name, c.Detail)
		if c.Fix != "" && c.Status != OK && c.Status != Skip {
			fmt.Fprintf(w, "      %-*s  fix: %s\n", width, "", c.Fix)
		}
	}
	fmt.Fprintf(w, "\n%d checks: %d failed, %d warnings\n", len(r.Checks), r.Failed, r.Warned)
}

// PrintJSON writes the report as one JSON object.
func (r *DoctorReport) PrintJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

// pgFacts are the figures several checks share.
type pgFacts struct {
	version    int // server_version_num
	user       string
	database   string
	table      cdc.TableName
	tableOID   uint32 // 0: no such table
	provider   *provider
	slotExists bool
	slotActive bool
}

func doctorPostgres(ctx context.Context, cfg config.Config, r *DoctorReport) {
	pgNames := []string{"postgres.version", "postgres.wal_level", "postgres.pending_restart", "postgres.max_replication_slots",
		"postgres.max_wal_senders", "postgres.role", "postgres.replication_connection", "postgres.outbox_table",
		"postgres.outbox_privileges", "postgres.publication", "postgres.slot", "postgres.failover",
		"postgres.direct", "postgres.max_slot_wal_keep_size", "postgres.idle_replication_slot_timeout", "postgres.sweeper_maintain", "postgres.outbox_partitions", "postgres.unprocessed_index", "postgres.track_commit_timestamp", "postgres.walbox_schema"}
	skipRest := func(why string) {
		for _, n := range pgNames {
			r.add(n, Skip, why, "")
		}
	}
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		r.add("postgres.connect", Fail, err.Error(), pgConnectFix(err))
		skipRest("no connection to PostgreSQL")
		return
	}
	defer closePG(ctx, conn)
	f := pgFacts{}
	var versionText string
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int, current_setting('server_version'), current_user, current_database()`).
		Scan(&f.version, &versionText, &f.user, &f.database); err != nil {
		r.add("postgres.connect", Fail, fmt.Sprintf("connected, but cannot query: %v", err), "")
		skipRest("cannot query PostgreSQL")
		return
	}
	r.add("postgres.connect", OK, fmt.Sprintf("connected to %s (PostgreSQL %s)", RedactPostgresURL(cfg.Postgres.URL), versionText), "")
	f.table, _ = tableOf(cfg)

	// Each check runs on its own: one failing query does not hide the others.
	checkVersion(f, versionText, r)
	checkDirect(ctx, conn, cfg, r)
	f.provider = detectProvider(ctx, conn)
	if f.provider != nil {
		r.add("postgres.provider", OK, "managed PostgreSQL: "+f.provider.Name+" (fixes below use its controls; docs/managed-postgres.md)", "")
	}
	checkWALLevel(ctx, conn, f, r)
	checkPendingRestart(ctx, conn, r)
	checkSlotsAndSenders(ctx, conn, cfg, &f, r)
	roleOK := checkRole(ctx, conn, &f, r)
	checkReplicationConnection(ctx, cfg, roleOK, r)
	checkOutboxTable(ctx, conn, cfg, &f, r)
	checkPublication(ctx, conn, cfg, f, r)
	checkSlot(ctx, conn, cfg, f, r)
	checkFailover(ctx, conn, cfg, f, r)
	checkKeepSize(ctx, conn, r)
	checkIdleSlotTimeout(ctx, conn, f, r)
	checkMaintain(ctx, conn, cfg, f, r)
	checkPartitions(ctx, conn, cfg, f, r)
	checkUnprocessedIndex(ctx, conn, f, r)
	checkCommitTimestamp(ctx, conn, r)
	checkWalboxSchema(ctx, conn, f, r)
}

func pgConnectFix(err error) string {
	msg := err.Error()
	switch {
	case fault.SQLState(err) == fault.InvalidPassword:
		return "check the user and password in postgres.url (or WALBOX_POSTGRES_URL)"
	case strings.Contains(msg, "pg_hba.conf"):
		return "add a pg_hba.conf line for walbox's role and address (host <db> <role> <addr>/32 scram-sha-256) and reload PostgreSQL"
	case fault.SQLState(err) == fault.InvalidCatalogName:
		return "create the database, or fix the database name in postgres.url"
	}
	return "check postgres.url (or WALBOX_POSTGRES_URL / --postgres-url): host, port, database, sslmode; is PostgreSQL running and reachable from here?"
}

// checkDirect looks for something between walbox and the server: the port
// the server listens on differs from the one in postgres.url (a pooler such
// as PgBouncer, or a proxy). A pooler cannot carry the replication
// connection; a plain TCP proxy can.
func checkDirect(ctx context.Context, conn *pgx.Conn, cfg config.Config, r *DoctorReport) {
	const name = "postgres.direct"
	var port *int
	if err := conn.QueryRow(ctx, `SELECT inet_server_port()`).Scan(&port); err != nil || port == nil {
		r.add(name, Skip, "connected over a Unix socket: nothing in between", "")
		return
	}
	pc, err := pgconn.ParseConfig(cfg.Postgres.URL)
	if err != nil || pc.Port == 0 {
		r.add(name, Skip, "cannot tell the port postgres.url uses", "")
		return
	}
	if int(pc.Port) != *port {
		r.add(name, Warn, fmt.Sprintf("postgres.url connects to port %d, but the server listens on %d: a pooler or a proxy is in between", pc.Port, *port),
			"a connection pooler (PgBouncer, a proxy in transaction mode) cannot carry walbox's replication connection: point postgres.url at the server itself (a plain TCP proxy is fine)")
		return
	}
	r.add(name, OK, fmt.Sprintf("connected to the server's own port %d", *port), "")
}

func checkVersion(f pgFacts, text string, r *DoctorReport) {
	major := f.version / 10000
	switch {
	case major < 14:
		r.add("postgres.version", Fail, fmt.Sprintf("PostgreSQL %s: walbox needs 14 or newer (pgoutput's messages option carries the heartbeat)", text),
			"upgrade PostgreSQL to 14 or newer (17+ for failover slots); see docs/operations.md, section Upgrades, before pg_upgrade")
	case major < 17:
		r.add("postgres.version", OK, fmt.Sprintf("PostgreSQL %s; before 17 a logical slot does not follow a failover to a standby (walbox then recreates it and republishes unprocessed rows)", text), "")
	default:
		r.add("postgres.version", OK, fmt.Sprintf("PostgreSQL %s: failover slots available (see postgres.failover)", text), "")
	}
}

func checkWALLevel(ctx context.Context, conn *pgx.Conn, f pgFacts, r *DoctorReport) {
	var level string
	var pending bool
	if err := conn.QueryRow(ctx, `SELECT setting, pending_restart FROM pg_settings WHERE name = 'wal_level'`).Scan(&level, &pending); err != nil {
		r.add("postgres.wal_level", Fail, fmt.Sprintf("cannot read wal_level: %v", err), "")
		return
	}
	switch {
	case level == "logical":
		r.add("postgres.wal_level", OK, "wal_level = logical", "")
	case pending:
		r.add("postgres.wal_level", Fail, fmt.Sprintf("wal_level is '%s'; a changed value waits for a restart (pending_restart)", level),
			"restart PostgreSQL: wal_level takes effect only at server start (a reload is not enough)")
	case f.provider != nil:
		r.add("postgres.wal_level", Fail, fmt.Sprintf("wal_level is '%s': logical decoding needs wal_level = logical", level), f.provider.WALFix)
	default:
		r.add("postgres.wal_level", Fail, fmt.Sprintf("wal_level is '%s': logical decoding needs wal_level = logical", level),
			"ALTER SYSTEM SET wal_level = logical; then restart PostgreSQL (a reload is not enough)")
	}
}

func checkPendingRestart(ctx context.Context, conn *pgx.Conn, r *DoctorReport) {
	rows, err := conn.Query(ctx, `SELECT name FROM pg_settings WHERE pending_restart ORDER BY name`)
	if err != nil {
		r.add("postgres.pending_restart", Skip, fmt.Sprintf("cannot read pg_settings: %v", err), "")
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		r.add("postgres.pending_restart", Skip, fmt.Sprintf("cannot read pg_settings: %v", err), "")
		return
	}
	if len(names) > 0 {
		r.add("postgres.pending_restart", Warn, "changed settings wait for a server restart: "+strings.Join(names, ", "),
			"restart PostgreSQL to apply them")
		return
	}
	r.add("postgres.pending_restart", OK, "no setting waits for a restart", "")
}

func checkSlotsAndSenders(ctx context.Context, conn *pgx.Conn, cfg config.Config, f *pgFacts, r *DoctorReport) {
	var maxSlots, usedSlots, maxSenders, usedSenders int
	err := conn.QueryRow(ctx, `SELECT current_setting('max_replication_slots')::int, (SELECT count(*) FROM pg_replication_slots)::int,
		current_setting('max_wal_senders')::int, (SELECT count(*) FROM pg_stat_replication)::int,
		EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1),
		EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)`, cfg.Postgres.Slot).
		Scan(&maxSlots, &usedSlots, &maxSenders, &usedSenders, &f.slotExists, &f.slotActive)
	if err != nil {
		r.add("postgres.max_replication_slots", Fail, fmt.Sprintf("cannot read slot usage: %v", err), "")
		r.add("postgres.max_wal_senders", Skip, "see postgres.max_replication_slots", "")
		return
	}
	need := 1
	if f.slotExists {
		need = 0 // walbox's slot is already among the used ones
	}
	detail := fmt.Sprintf("%d of %d slots used", usedSlots, maxSlots)
	switch free := maxSlots - usedSlots; {
	case free < need:
		r.add("postgres.max_replication_slots", Fail, detail+"; walbox needs one more for slot "+cfg.Postgres.Slot,
			"raise max_replication_slots (ALTER SYSTEM SET max_replication_slots = "+strconv.Itoa(maxSlots+4)+"; restart PostgreSQL), or drop unused slots (SELECT slot_name, active FROM pg_replication_slots)")
	case free-need == 0:
		r.add("postgres.max_replication_slots", Warn, detail+"; none left after walbox's (another tool, or a recreated slot during a pg_upgrade test, would fail)",
			"raise max_replication_slots a little (restart required)")
	default:
		r.add("postgres.max_replication_slots", OK, detail, "")
	}
	needSender := 1
	if f.slotActive {
		needSender = 0
	}
	detail = fmt.Sprintf("%d of %d WAL senders in use", usedSenders, maxSenders)
	if maxSenders-usedSenders < needSender {
		r.add("postgres.max_wal_senders", Fail, detail+"; walbox's replication connection needs one",
			"raise max_wal_senders (ALTER SYSTEM SET max_wal_senders = "+strconv.Itoa(maxSenders+4)+"; restart PostgreSQL)")
		return
	}
	r.add("postgres.max_wal_senders", OK, detail, "")
}

func checkRole(ctx context.Context, conn *pgx.Conn, f *pgFacts, r *DoctorReport) bool {
	var repl, super bool
	if err := conn.QueryRow(ctx, `SELECT rolreplication, rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&repl, &super); err != nil {
		r.add("postgres.role", Fail, fmt.Sprintf("cannot read role %s: %v", f.user, err), "")
		return false
	}
	member := false
	if f.provider != nil && f.provider.ReplicationRole != "" {
		_ = conn.QueryRow(ctx, `SELECT pg_has_role(current_user, $1, 'MEMBER')`, f.provider.ReplicationRole).Scan(&member)
	}
	switch {
	case super:
		r.add("postgres.role", OK, fmt.Sprintf("role %s is a superuser (works; a least-privilege role is better: walbox migrate --print-grants)", f.user), "")
	case repl:
		r.add("postgres.role", OK, fmt.Sprintf("role %s has REPLICATION", f.user), "")
	case member:
		r.add("postgres.role", OK, fmt.Sprintf("role %s is a member of %s (%s's replication role)", f.user, f.provider.ReplicationRole, f.provider.Name), "")
	case f.provider != nil:
		r.add("postgres.role", Fail, fmt.Sprintf("role %s may not use replication", f.user), strings.ReplaceAll(f.provider.RoleFix, "<role>", cdc.QuoteIdent(f.user)))
		return false
	default:
		r.add("postgres.role", Fail, fmt.Sprintf("role %s may not use replication (no REPLICATION attribute)", f.user),
			fmt.Sprintf("as a superuser: ALTER ROLE %s WITH REPLICATION; (the whole recipe: walbox migrate --print-grants --role %s)", cdc.QuoteIdent(f.user), f.user))
		return false
	}
	return true
}

// checkReplicationConnection opens a replication connection as walbox does,
// which is the only way to see pg_hba.conf's replication lines at work.
func checkReplicationConnection(ctx context.Context, cfg config.Config, roleOK bool, r *DoctorReport) {
	if !roleOK {
		r.add("postgres.replication_connection", Skip, "the role may not replicate (see postgres.role)", "")
		return
	}
	pc, err := pgconn.ParseConfig(cfg.Postgres.URL)
	if err != nil {
		r.add("postgres.replication_connection", Fail, fmt.Sprintf("postgres.url: %v", err), "")
		return
	}
	pc.RuntimeParams["replication"] = "database"
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	defer cancel()
	rc, err := pgconn.ConnectConfig(cctx, pc)
	if err != nil {
		fix := "check that the server accepts replication connections from here"
		if strings.Contains(err.Error(), "unsupported startup parameter") {
			fix = "a connection pooler (PgBouncer) answered: it cannot carry replication; point postgres.url at the server itself"
		}
		if strings.Contains(err.Error(), "pg_hba.conf") {
			fix = fmt.Sprintf("add a pg_hba.conf line for the database, e.g. `host %s %s <walbox address>/32 scram-sha-256`, and reload PostgreSQL (a logical replication connection is matched by database name; the keyword `replication` matches physical replication only)", pc.Database, pc.User)
		}
		r.add("postgres.replication_connection", Fail, fmt.Sprintf("replication connection refused: %v", err), fix)
		return
	}
	defer rc.Close(context.WithoutCancel(ctx))
	if _, err := rc.Exec(cctx, "IDENTIFY_SYSTEM").ReadAll(); err != nil {
		r.add("postgres.replication_connection", Fail, fmt.Sprintf("IDENTIFY_SYSTEM failed: %v", err), "")
		return
	}
	r.add("postgres.replication_connection", OK, "replication connection accepted (pg_hba.conf allows it)", "")
}

func checkOutboxTable(ctx context.Context, conn *pgx.Conn, cfg config.Config, f *pgFacts, r *DoctorReport) {
	var oid *uint32
	if err := conn.QueryRow(ctx, `SELECT to_regclass($1)::oid`, f.table.Quoted()).Scan(&oid); err != nil {
		r.add("postgres.outbox_table", Fail, fmt.Sprintf("cannot look up %s: %v", f.table, err), "")
		r.add("postgres.outbox_privileges", Skip, "see postgres.outbox_table", "")
		return
	}
	if oid == nil {
		r.add("postgres.outbox_table", Fail, fmt.Sprintf("outbox table %s does not exist", f.table),
			"run `walbox migrate` (as the table owner) to create it, or set outbox.table to your existing outbox table")
		r.add("postgres.outbox_privileges", Skip, "see postgres.outbox_table", "")
		return
	}
	f.tableOID = *oid
	rows, err := conn.Query(ctx, `SELECT attname FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped`, f.tableOID)
	if err != nil {
		r.add("postgres.outbox_table", Fail, fmt.Sprintf("cannot read the columns of %s: %v", f.table, err), "")
		return
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		r.add("postgres.outbox_table", Fail, fmt.Sprintf("cannot read the columns of %s: %v", f.table, err), "")
		return
	}
	has := map[string]bool{}
	for _, n := range names {
		has[n] = true
	}
	cols, _ := cdc.ColumnsFromMap(cfg.Outbox.Columns, true)
	var missing []string
	for _, role := range []cdc.Role{cdc.RoleID, cdc.RoleTopic, cdc.RolePayload} {
		if !has[cols[role]] {
			missing = append(missing, fmt.Sprintf("%s (role %s)", cols[role], role))
		}
	}
	if len(missing) > 0 {
		r.add("postgres.outbox_table", Fail, fmt.Sprintf("%s has no column %s", f.table, strings.Join(missing, ", ")),
			"map the roles to your column names in outbox.columns (e.g. outbox.columns: {id: event_id})")
	} else {
		r.add("postgres.outbox_table", OK, fmt.Sprintf("%s exists with the id, topic and payload columns", f.table), "")
	}

	var sel bool
	if err := conn.QueryRow(ctx, `SELECT has_table_privilege($1::oid, 'SELECT')`, f.tableOID).Scan(&sel); err != nil {
		r.add("postgres.outbox_privileges", Fail, fmt.Sprintf("cannot check privileges: %v", err), "")
		return
	}
	var noUpdate []string
	if cfg.Sweeper.MarkProcessed {
		for _, c := range []string{"processed", "processed_at", "error", "attempts"} {
			if !has[c] {
				continue
			}
			var ok bool
			if err := conn.QueryRow(ctx, `SELECT has_column_privilege($1::oid, $2, 'UPDATE')`, f.tableOID, c).Scan(&ok); err != nil {
				r.add("postgres.outbox_privileges", Fail, fmt.Sprintf("cannot check privileges: %v", err), "")
				return
			}
			if !ok {
				noUpdate = append(noUpdate, c)
			}
		}
	}
	switch {
	case !sel:
		r.add("postgres.outbox_privileges", Fail, fmt.Sprintf("role %s may not SELECT from %s (the snapshot backfill and replay read it)", f.user, f.table),
			fmt.Sprintf("GRANT SELECT ON %s TO %s;", f.table.Quoted(), cdc.QuoteIdent(f.user)))
	case len(noUpdate) > 0:
		r.add("postgres.outbox_privileges", Fail, fmt.Sprintf("role %s may not UPDATE %s of %s: the sweeper cannot mark rows processed", f.user, strings.Join(noUpdate, ", "), f.table),
			fmt.Sprintf("GRANT UPDATE (%s) ON %s TO %s; or set sweeper.mark_processed: false", strings.Join(noUpdate, ", "), f.table.Quoted(), cdc.QuoteIdent(f.user)))
	case !cfg.Sweeper.MarkProcessed:
		r.add("postgres.outbox_privileges", OK, "SELECT granted (sweeper.mark_processed is false: no UPDATE needed)", "")
	case !has["processed"]:
		r.add("postgres.outbox_privileges", OK, "SELECT granted (the table has no processed column: the sweeper marks nothing)", "")
	default:
		r.add("postgres.outbox_privileges", OK, "SELECT and UPDATE of the processed columns granted", "")
	}
}

func checkPublication(ctx context.Context, conn *pgx.Conn, cfg config.Config, f pgFacts, r *DoctorReport) {
	name := cfg.Postgres.Publication
	create := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true)", cdc.QuoteIdent(name), f.table.Quoted())
	var ins, viaRoot, hasTable bool
	err := conn.QueryRow(ctx, `SELECT pubinsert, pubviaroot,
		EXISTS (SELECT 1 FROM pg_publication_tables t WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
		FROM pg_publication p WHERE pubname = $1`, name, f.table.Schema, f.table.Name).Scan(&ins, &viaRoot, &hasTable)
	if errors.Is(err, pgx.ErrNoRows) {
		owner := false
		if f.tableOID != 0 {
			_ = conn.QueryRow(ctx, `SELECT pg_has_role(current_user, relowner, 'USAGE') FROM pg_class WHERE oid = $1`, f.tableOID).Scan(&owner)
		}
		if cfg.Postgres.CreatePublication && owner {
			r.add("postgres.publication", Warn, fmt.Sprintf("publication %q does not exist; walbox run will create it (its role owns %s)", name, f.table),
				"run `walbox migrate` now to create it ahead of time")
			return
		}
		r.add("postgres.publication", Fail, fmt.Sprintf("publication %q does not exist", name),
			"run `walbox migrate` as the table owner, or as the table owner: "+create)
		return
	}
	if err != nil {
		r.add("postgres.publication", Fail, fmt.Sprintf("cannot read publication %q: %v", name, err), "")
		return
	}
	partitioned := false
	if !viaRoot && f.tableOID != 0 {
		// publish_via_partition_root matters only for a partitioned outbox.
		if err := conn.QueryRow(ctx, `SELECT relkind = 'p' FROM pg_class WHERE oid = $1`, f.tableOID).Scan(&partitioned); err != nil {
			r.add("postgres.publication", Fail, fmt.Sprintf("cannot read the kind of %s: %v", f.table, err), "")
			return
		}
	}
	switch {
	case !viaRoot && partitioned:
		// (pg_publication_tables then lists the partitions, not the table.)
		r.add("postgres.publication", Fail, fmt.Sprintf("publication %q has publish_via_partition_root off (pubviaroot): rows of a partitioned outbox would arrive under partition names", name),
			fmt.Sprintf("ALTER PUBLICATION %s SET (publish_via_partition_root = true)", cdc.QuoteIdent(name)))
	case !hasTable:
		r.add("postgres.publication", Fail, fmt.Sprintf("publication %q does not include %s", name, f.table),
			fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", cdc.QuoteIdent(name), f.table.Quoted()))
	case !ins:
		r.add("postgres.publication", Fail, fmt.Sprintf("publication %q does not publish inserts (pubinsert is false)", name),
			fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert', publish_via_partition_root = true)", cdc.QuoteIdent(name)))
	case !viaRoot:
		r.add("postgres.publication", OK, fmt.Sprintf("publication %q covers %s (inserts; the table is not partitioned)", name, f.table), "")
	default:
		r.add("postgres.publication", OK, fmt.Sprintf("publication %q covers %s (inserts, via partition root)", name, f.table), "")
	}
}

func checkSlot(ctx context.Context, conn *pgx.Conn, cfg config.Config, f pgFacts, r *DoctorReport) {
	slot := cfg.Postgres.Slot
	st, err := cdc.ReadSlotStatus(ctx, conn, slot)
	if errors.Is(err, cdc.ErrNoSlot) {
		r.add("postgres.slot", OK, fmt.Sprintf("slot %q not created yet: walbox run creates it (and publishes the unprocessed rows from a snapshot)", slot), "")
		return
	}
	if err != nil {
		r.add("postgres.slot", Fail, err.Error(), "")
		return
	}
	active := "inactive"
	if st.Active {
		active = fmt.Sprintf("active (pid %d)", st.ActivePID)
	}
	detail := fmt.Sprintf("slot %q: plugin %s, %s, wal_status %s, retaining %s of WAL", slot, st.Plugin, active, orDash(st.WALStatus), HumanBytes(st.RetainedBytes))
	drop := fmt.Sprintf("walbox slot drop (or SELECT pg_drop_replication_slot('%s'))", slot)
	switch {
	case st.Plugin != "pgoutput":
		r.add("postgres.slot", Fail, detail+": walbox needs pgoutput",
			fmt.Sprintf("choose another postgres.slot, or drop this one if nothing else uses it: %s", drop))
	case st.Database != f.database:
		r.add("postgres.slot", Fail, fmt.Sprintf("slot %q belongs to database %s, not %s", slot, st.Database, f.database),
			"choose another postgres.slot (slot names are per cluster)")
	case st.WALStatus == "lost":
		fix := "walbox run drops and recreates it and republishes every unprocessed row (postgres.on_slot_lost: recreate)"
		if cfg.Postgres.OnSlotLost == "fail" {
			fix = "postgres.on_slot_lost is fail: " + drop + ", then start walbox run: it recreates the slot and republishes unprocessed rows"
		}
		r.add("postgres.slot", Fail, detail+": the slot was invalidated (the WAL it needed is gone)", fix)
	case st.WALStatus == "unreserved":
		r.add("postgres.slot", Warn, detail+": it will be invalidated at the next checkpoint unless it catches up",
			"start walbox (or let it catch up) now, or raise max_slot_wal_keep_size")
	case st.WALStatus == "extended":
		r.add("postgres.slot", Warn, detail+": it retains more than max_wal_size", "check that walbox is running and keeping up (walbox status)")
	default:
		r.add("postgres.slot", OK, detail, "")
	}
}

func checkFailover(ctx context.Context, conn *pgx.Conn, cfg config.Config, f pgFacts, r *DoctorReport) {
	if f.version < 170000 {
		r.add("postgres.failover", Skip, "PostgreSQL before 17 has no failover slots: after a failover walbox recreates the slot on the new primary and republishes unprocessed rows (docs/operations.md)", "")
		return
	}
	var standbySlots string
	_ = conn.QueryRow(ctx, `SELECT current_setting('synchronized_standby_slots', true)`).Scan(&standbySlots)
	var physical int
	_ = conn.QueryRow(ctx, `SELECT count(*)::int FROM pg_replication_slots WHERE slot_type = 'physical'`).Scan(&physical)
	if !f.slotExists {
		r.add("postgres.failover", OK, "slot not created yet; to survive failover create it with `walbox slot create --failover`", "")
		return
	}
	var failover bool
	if err := conn.QueryRow(ctx, `SELECT failover FROM pg_replication_slots WHERE slot_name = $1`, cfg.Postgres.Slot).Scan(&failover); err != nil {
		r.add("postgres.failover", Skip, fmt.Sprintf("cannot read the slot's failover flag: %v", err), "")
		return
	}
	switch {
	case failover && standbySlots == "":
		r.add("postgres.failover", Warn, "the slot has failover = true, but synchronized_standby_slots is empty: walbox may read changes a promoted standby never received",
			"ALTER SYSTEM SET synchronized_standby_slots = '<physical slot of each standby>'; SELECT pg_reload_conf(); and on the standbys: sync_replication_slots = on, hot_standby_feedback = on")
	case failover:
		r.add("postgres.failover", OK, "the slot has failover = true; synchronized_standby_slots = "+standbySlots, "")
	case physical > 0:
		r.add("postgres.failover", Warn, fmt.Sprintf("the cluster has %d physical (standby) slot(s), but walbox's slot has failover = false: it will not exist on a promoted standby", physical),
			fmt.Sprintf("on a replication connection: ALTER_REPLICATION_SLOT %s (FAILOVER true); set synchronized_standby_slots on the primary and sync_replication_slots = on on the standbys", cfg.Postgres.Slot))
	default:
		r.add("postgres.failover", OK, "no physical standby slots; the slot's failover flag is off", "")
	}
}

// readSetting reads the server setting called setting; when it cannot, it
// reports check name skipped and returns false.
func readSetting(ctx context.Context, conn *pgx.Conn, r *DoctorReport, name, setting string) (string, bool) {
	var v string
	if err := conn.QueryRow(ctx, `SELECT current_setting($1)`, setting).Scan(&v); err != nil {
		r.add(name, Skip, fmt.Sprintf("cannot read it: %v", err), "")
		return "", false
	}
	return v, true
}

func checkKeepSize(ctx context.Context, conn *pgx.Conn, r *DoctorReport) {
	v, ok := readSetting(ctx, conn, r, "postgres.max_slot_wal_keep_size", "max_slot_wal_keep_size")
	if !ok {
		return
	}
	if v == "-1" {
		r.add("postgres.max_slot_wal_keep_size", Warn, "max_slot_wal_keep_size = -1 (unlimited): a slot whose reader is gone retains WAL until the disk fills",
			"ALTER SYSTEM SET max_slot_wal_keep_size = '50GB'; SELECT pg_reload_conf(); (a size your disk can afford; past it the slot is invalidated and walbox recreates it and republishes unprocessed rows)")
		return
	}
	r.add("postgres.max_slot_wal_keep_size", OK, "max_slot_wal_keep_size = "+v, "")
}

// checkMaintain: partition upkeep and archival need ownership of the table.
func checkMaintain(ctx context.Context, conn *pgx.Conn, cfg config.Config, f pgFacts, r *DoctorReport) {
	const name = "postgres.sweeper_maintain"
	if !cfg.Sweeper.Maintain {
		r.add(name, OK, "sweeper.maintain is false: partitions and archival are left to the DBA (walbox archive, walbox.ensure_partitions)", "")
		return
	}
	if f.tableOID == 0 {
		r.add(name, Skip, "no outbox table to check", "")
		return
	}
	var owner bool
	if err := conn.QueryRow(ctx, `SELECT pg_has_role(current_user, relowner, 'MEMBER') FROM pg_class WHERE oid = $1`, f.tableOID).Scan(&owner); err != nil {
		r.add(name, Skip, fmt.Sprintf("cannot read the table's owner: %v", err), "")
		return
	}
	if !owner {
		r.add(name, Warn, fmt.Sprintf("%s does not own %s: partition upkeep and archival will fail (the sweeper warns once and goes on marking rows)", f.user, f.table),
			fmt.Sprintf("GRANT <owner of %s> TO %s; or set sweeper.maintain: false and keep partitions and archival in a DBA job", f.table, f.user))
		return
	}
	r.add(name, OK, fmt.Sprintf("%s owns %s: walbox keeps partitions ahead and archives", f.user, f.table), "")
}

// checkPartitions: without a default partition an INSERT past the newest
// partition fails, and a default partition keeps archival from detaching
// concurrently (docs/sweeper.md, The default partition).
func checkPartitions(ctx context.Context, conn *pgx.Conn, cfg config.Config, f pgFacts, r *DoctorReport) {
	const name = "postgres.outbox_partitions"
	if f.tableOID == 0 {
		r.add(name, Skip, "no outbox table to check", "")
		return
	}
	var partitioned bool
	var dated int
	var newest *time.Time
	var def, defName *string // the default partition, and its name in its schema
	err := conn.QueryRow(ctx, `
		SELECT c.relkind = 'p',
		       (SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
		         WHERE i.inhparent = c.oid AND pg_get_expr(p.relpartbound, p.oid) <> 'DEFAULT')::int,
		       (SELECT max(b[1]::timestamptz) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid,
		               regexp_match(pg_get_expr(p.relpartbound, p.oid), 'TO \(''([^'']*)''\)') b
		         WHERE i.inhparent = c.oid AND NOT i.inhdetachpending),
		       d.oid::regclass::text, d.relname::text
		FROM pg_class c
		LEFT JOIN LATERAL (SELECT p.oid, p.relname FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
		         WHERE i.inhparent = c.oid AND pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT') d ON true
		WHERE c.oid = $1`, f.tableOID).Scan(&partitioned, &dated, &newest, &def, &defName)
	if err != nil {
		r.add(name, Skip, fmt.Sprintf("cannot read the partitions of %s: %v", f.table, err), "")
		return
	}
	if !partitioned {
		r.add(name, OK, fmt.Sprintf("%s is not partitioned: nothing to keep ahead", f.table), "")
		return
	}
	daysAhead := func() float64 { return time.Until(*newest).Hours() / 24 }
	ensure := fmt.Sprintf("SELECT walbox.ensure_partitions(%s::regclass); as the table's owner (walbox run does it every 10 minutes with sweeper.maintain and ownership)",
		cdc.QuoteLiteral(f.table.String()))
	if def == nil && (newest == nil || daysAhead() < 2) {
		when := "no dated partition"
		if newest != nil {
			when = fmt.Sprintf("the newest partition ends %s (%.1f days from now)", newest.Format(time.DateOnly), daysAhead())
		}
		r.add(name, Fail, fmt.Sprintf("%s: %s, and there is no default partition: INSERTs past it fail", f.table, when), ensure)
		return
	}
	if def != nil {
		// The sweeper removes the one an older walbox made (removeDefault).
		if *defName == f.table.Name+"_default" && cfg.Sweeper.Maintain {
			r.add(name, OK, fmt.Sprintf("%s has the default partition %s an older walbox made: the sweeper moves its rows out and removes it at its next maintenance", f.table, *def), "")
			return
		}
		r.add(name, Warn, fmt.Sprintf("%s has a default partition %s: PostgreSQL refuses DETACH ... CONCURRENTLY next to it, so archival takes ACCESS EXCLUSIVE on the outbox (up to sweeper.lock_timeout per attempt)", f.table, *def),
			fmt.Sprintf("once it is empty: ALTER TABLE %s DETACH PARTITION %s; DROP TABLE %s; (walbox keeps partitions %d days ahead instead)", f.table, *def, *def, cfg.Sweeper.PartitionsAhead))
		return
	}
	r.add(name, OK, fmt.Sprintf("%d dated partitions, the newest ending %s (%.1f days ahead); no default partition", dated, newest.Format(time.DateOnly), daysAhead()), "")
}

// checkUnprocessedIndex: the queries for unprocessed rows are answered by a
// partial index only if its predicate is written as they are
// (cdc.Unprocessed): NOT processed on a NOT NULL column, processed IS NOT
// TRUE on a nullable one.
func checkUnprocessedIndex(ctx context.Context, conn *pgx.Conn, f pgFacts, r *DoctorReport) {
	const name = "postgres.unprocessed_index"
	if f.tableOID == 0 {
		r.add(name, Skip, "no outbox table to check", "")
		return
	}
	exists, notNull, err := cdc.ProcessedFlag(ctx, conn, f.table)
	if err != nil {
		r.add(name, Skip, err.Error(), "")
		return
	}
	if !exists {
		r.add(name, OK, fmt.Sprintf("%s has no boolean processed column: nothing to index", f.table), "")
		return
	}
	want := cdc.Unprocessed("", notNull)
	var found bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = $1 AND i.indpred IS NOT NULL
		AND pg_get_expr(i.indpred, i.indrelid) IN ($2, '(' || $2 || ')'))`, f.tableOID, want).Scan(&found); err != nil {
		r.add(name, Skip, fmt.Sprintf("cannot read the indexes of %s: %v", f.table, err), "")
		return
	}
	if !found {
		r.add(name, Warn, fmt.Sprintf("no partial index of %s has the predicate %s: the sweeper's gauges and counts, status and a backfill read every partition in full", f.table, want),
			fmt.Sprintf("CREATE INDEX ON %s (created_at) WHERE %s; (per partition with CONCURRENTLY on a busy table: docs/sweeper.md, Indexes)", f.table, want))
		return
	}
	r.add(name, OK, fmt.Sprintf("a partial index of %s answers %s", f.table, want), "")
}

// checkIdleSlotTimeout: PostgreSQL 18 invalidates a slot that has had no
// reader for idle_replication_slot_timeout, at the next checkpoint. walbox
// away that long (stopped, failing over, a long NATS outage does not count:
// it keeps streaming) then finds its slot gone.
func checkIdleSlotTimeout(ctx context.Context, conn *pgx.Conn, f pgFacts, r *DoctorReport) {
	const name = "postgres.idle_replication_slot_timeout"
	if f.version < 180000 {
		r.add(name, OK, "not in this PostgreSQL (18+): an idle slot is never invalidated for idleness", "")
		return
	}
	v, ok := readSetting(ctx, conn, r, name, "idle_replication_slot_timeout")
	if !ok {
		return
	}
	if v == "0" {
		r.add(name, OK, "idle_replication_slot_timeout = 0: slots are not invalidated for being idle", "")
		return
	}
	r.add(name, Warn, fmt.Sprintf("idle_replication_slot_timeout = %s: if walbox is stopped longer than that, its slot is invalidated at the next checkpoint; walbox then recreates it and republishes the unprocessed rows, but table-less events (walbox.emit_message) of that time are lost", v),
		"ALTER SYSTEM SET idle_replication_slot_timeout = 0; SELECT pg_reload_conf(); (or a value longer than any walbox outage you plan for)")
}

func checkCommitTimestamp(ctx context.Context, conn *pgx.Conn, r *DoctorReport) {
	v, ok := readSetting(ctx, conn, r, "postgres.track_commit_timestamp", "track_commit_timestamp")
	if !ok {
		return
	}
	if v == "on" {
		r.add("postgres.track_commit_timestamp", OK, "on: a recreated slot's backfill republishes unprocessed rows in exact commit order", "")
		return
	}
	r.add("postgres.track_commit_timestamp", OK, "off (info): when a lost slot is recreated, unprocessed rows are republished in created_at, id order; "+
		"ALTER SYSTEM SET track_commit_timestamp = on and a restart give exact commit order", "")
}

func checkWalboxSchema(ctx context.Context, conn *pgx.Conn, f pgFacts, r *DoctorReport) {
	// Looked up in the catalog: to_regclass needs USAGE on the schema.
	var usage bool
	var status, marker *bool // nil: no such table
	err := conn.QueryRow(ctx, `SELECT coalesce(has_schema_privilege(n.oid, 'USAGE'), false),
		(SELECT has_table_privilege(c.oid, 'INSERT') AND has_table_privilege(c.oid, 'UPDATE')
		   FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'relay_status'),
		(SELECT has_table_privilege(c.oid, 'SELECT') AND has_table_privilege(c.oid, 'INSERT')
		        AND has_table_privilege(c.oid, 'UPDATE') AND has_table_privilege(c.oid, 'DELETE')
		   FROM pg_class c WHERE c.relnamespace = n.oid AND c.relname = 'slot_backfill')
		FROM pg_namespace n WHERE n.nspname = 'walbox'`).Scan(&usage, &status, &marker)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		r.add("postgres.walbox_schema", Skip, fmt.Sprintf("cannot look it up: %v", err), "")
		return
	}
	if status == nil {
		r.add("postgres.walbox_schema", Warn, "walbox.relay_status does not exist (walbox migrate not applied): producers' back-pressure (outbox.Lag) and `walbox status` will not see the relay's lag, and an interrupted backfill cannot be detected",
			"run `walbox migrate` (or apply `walbox migrate --print`)")
		return
	}
	role := cdc.QuoteIdent(f.user)
	var grants []string
	if !usage {
		grants = append(grants, fmt.Sprintf("GRANT USAGE ON SCHEMA walbox TO %s;", role))
	}
	if marker != nil && (!usage || !*marker) {
		r.add("postgres.walbox_schema", Fail, "the role may not read and write walbox.slot_backfill: walbox run cannot create its slot (the backfill marker)",
			strings.Join(append(grants, fmt.Sprintf("GRANT SELECT, INSERT, UPDATE, DELETE ON walbox.slot_backfill TO %s;", role),
				fmt.Sprintf("GRANT SELECT, INSERT, UPDATE ON walbox.relay_status TO %s;", role)), " "))
		return
	}
	if !usage || !*status {
		r.add("postgres.walbox_schema", Warn, "the role may not write walbox.relay_status: the relay's lag will not be visible",
			strings.Join(append(grants, fmt.Sprintf("GRANT SELECT, INSERT, UPDATE ON walbox.relay_status TO %s;", role)), " "))
		return
	}
	if marker == nil {
		r.add("postgres.walbox_schema", OK, "walbox.relay_status exists and is writable (walbox.slot_backfill does not exist: run walbox migrate to add it)", "")
		return
	}
	r.add("postgres.walbox_schema", OK, "walbox.relay_status and walbox.slot_backfill exist and are writable", "")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
