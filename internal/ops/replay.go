package ops

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
)

// HeaderReplayOf names the event a --force-new-id replay delivers again.
const HeaderReplayOf = relay.HeaderReplayOf

// replayWindow is how many publishes may wait for their acks.
const replayWindow = 256

// ReplayOptions select the rows to republish and how.
type ReplayOptions struct {
	// From and To bound created_at: From <= created_at < To (zero: open).
	From, To time.Time
	// Topic is a NATS-style pattern (* and >) over the topic column.
	Topic string
	// IDs restrict the replay to these event ids.
	IDs []string
	// Table is the outbox table to replay from (schema.table); "" is the
	// default one. Its columns, routing and envelope apply.
	Table string
	// Archive reads walbox.<table>_archive instead of the outbox table.
	Archive bool
	// ForceNewID publishes under new ids (<id>.replay.<unix-nanos>, header
	// Walbox-Replay-Of = id) so consumers get the events again.
	ForceNewID bool
	// NoCheck skips reading back which ids the streams hold: only
	// JetStream's duplicate window then stops a second copy.
	NoCheck bool
	// DryRun counts what would be published and publishes nothing.
	DryRun bool
	// Progress receives progress (a bar when TTY, else periodic lines).
	Progress io.Writer
	TTY      bool
}

// ReplayResult counts what a replay did (or, dry, would do).
type ReplayResult struct {
	Table  string `json:"table"`
	Rows   int64  `json:"rows"`    // rows in the created_at/id selection
	Events int64  `json:"matched"` // of those, matching the topic pattern
	// AlreadyStored events were found in their stream before publishing
	// and skipped.
	AlreadyStored int64 `json:"already_stored"`
	// Duplicates were dropped by JetStream (PubAck.Duplicate): inside the
	// duplicate window.
	Duplicates   int64            `json:"duplicates"`
	Published    int64            `json:"published"`
	DeadLettered int64            `json:"dead_lettered"`
	ByStream     map[string]int64 `json:"by_stream"` // events to publish per stream
	DryRun       bool             `json:"dry_run"`
	NewIDSuffix  string           `json:"new_id_suffix,omitempty"`
	terms        busops.Terms
}

// Print writes the summary.
func (r *ReplayResult) Print(w io.Writer) {
	verb := "published"
	if r.DryRun {
		verb = "would publish"
	}
	fmt.Fprintf(w, "replay of %s: %d rows selected, %d matching\n", r.Table, r.Rows, r.Events)
	streams := make([]string, 0, len(r.ByStream))
	for s := range r.ByStream {
		streams = append(streams, s)
	}
	sort.Strings(streams)
	for _, s := range streams {
		fmt.Fprintf(w, "  %-20s %d\n", s, r.ByStream[s])
	}
	if r.DryRun {
		fmt.Fprintf(w, "%s %d, skip %d already in their stream, dead-letter %d (dry run: nothing published)\n",
			verb, r.Published, r.AlreadyStored, r.DeadLettered)
		return
	}
	dups := ""
	if r.terms.Dedupes {
		dups = fmt.Sprintf(", duplicates dropped by JetStream %d", r.Duplicates)
	}
	fmt.Fprintf(w, "%s %d, already in the %s (skipped) %d%s, dead-lettered %d\n",
		verb, r.Published, r.terms.Stream, r.AlreadyStored, dups, r.DeadLettered)
	if r.NewIDSuffix != "" {
		fmt.Fprintf(w, "new ids: <id>%s (header %s: <id>)\n", r.NewIDSuffix, HeaderReplayOf)
	}
}

// ParseTime reads a --from/--to value: RFC 3339, "2006-01-02 15:04[:05]"
// or "2006-01-02" (local time), "now", or a duration meaning that long ago
// ("90m", "24h").
func ParseTime(s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, nil
	}
	if s == "now" {
		return now, nil
	}
	if d, err := time.ParseDuration(s); err == nil {
		return now.Add(-d), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range []string{"2006-01-02T15:04:05", "2006-01-02 15:04:05", "2006-01-02T15:04", "2006-01-02 15:04", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.Local); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%q is not a time: use RFC 3339 (2024-05-01T12:00:00Z), 2024-05-01 12:00, 2024-05-01, now, or a duration ago (90m)", s)
}

// Replay republishes outbox (or archive) rows through the relay's router,
// so subjects, headers, the subject prefix and the stream checks are those
// of live publishing, in created_at, id order. By default each event keeps
// its id: events the stream already holds are skipped (read back from the
// stream; inside the duplicate window JetStream drops them too), so a
// replay only fills gaps. An event the router rejects is dead-lettered as
// the relay would. With sink: kafka the topics' Walbox-Event-Id headers
// are read back instead (from the first offsets stored since the oldest
// row's created_at, less a minute), and Kafka drops no duplicate itself.
func Replay(ctx context.Context, cfg config.Config, opts ReplayOptions) (*ReplayResult, error) {
	t, idx, table, err := replayTable(cfg, opts)
	if err != nil {
		return nil, err
	}
	res := &ReplayResult{Table: table.String(), ByStream: map[string]int64{}, DryRun: opts.DryRun}
	conn, err := connectPG(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer closePG(ctx, conn)
	bus, err := openBus(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer bus.Close()
	res.terms = bus.Terms()
	cctx, cancel := context.WithTimeout(ctx, connectTimeout)
	routes, err := bus.Routes(cctx)
	cancel()
	if err != nil {
		return nil, err
	}
	router, err := bus.Router(source(cfg), routes)
	if err != nil {
		return nil, err
	}
	// The replayed events are of one table: its routing and envelope,
	// under its index in the config as the relay has it (a table after
	// the first publishes under a Nats-Msg-Id qualified with its name).
	if err := router.SetTable(idx, t.RouterOptions(cfg.SinkTemplate())); err != nil {
		return nil, &config.Error{Key: t.Key, Msg: err.Error()}
	}
	// What counts as stored: a message of this source and table with the
	// row's id (one of the first table may name no table: a relay from
	// before walbox recorded it).
	owner := storedOwner{source: source(cfg), tables: []string{t.Name.String()}}
	if idx == 0 {
		owner.tables = append(owner.tables, "")
	}

	q, err := newRowQuery(ctx, conn, table, t.Columns, opts, owner)
	if err != nil {
		return nil, err
	}
	var minCreated *time.Time
	if err := conn.QueryRow(ctx, q.countSQL, q.countArgs...).Scan(&res.Rows, &minCreated); err != nil {
		return nil, fmt.Errorf("count the rows of %s: %w", table, err)
	}
	if res.Rows == 0 {
		return res, nil
	}
	if q.checkStored {
		// Only the subjects this table's events of --topic can have: its
		// own template's, not the sink's ("" reads every subject).
		filter := router.SubjectFilter(idx, opts.Topic)
		if err := loadStoredIDs(ctx, conn, bus, routes, filter, minCreated); err != nil {
			return nil, err
		}
	}
	return res, replayRows(ctx, conn, q, bus, router, idx, opts, res)
}

// storedOwner is whose stored messages a replay's rows match: the source
// (Walbox-Source) and the table names (Walbox-Table) of the replayed table.
type storedOwner struct {
	source string
	tables []string
}

// replayTable checks opts and finds the table to read: the configured
// outbox table opts names (the default one when none), its index among the
// configured tables (the relay's cdc.Event.Table), or its archive.
func replayTable(cfg config.Config, opts ReplayOptions) (config.Table, int, cdc.TableName, error) {
	if opts.From.IsZero() && opts.To.IsZero() && len(opts.IDs) == 0 {
		return config.Table{}, 0, cdc.TableName{}, errors.New("select the events: --from and --to (created_at range), and/or --id")
	}
	if !opts.From.IsZero() && !opts.To.IsZero() && !opts.From.Before(opts.To) {
		return config.Table{}, 0, cdc.TableName{}, fmt.Errorf("--from (%s) must be before --to (%s)", opts.From.Format(time.RFC3339), opts.To.Format(time.RFC3339))
	}
	t, err := cfg.TableNamed(opts.Table)
	if err != nil {
		return config.Table{}, 0, cdc.TableName{}, &config.Error{Key: "--table", Msg: err.Error()}
	}
	all, err := cfg.Tables()
	if err != nil {
		return config.Table{}, 0, cdc.TableName{}, err
	}
	idx := slices.IndexFunc(all, func(c config.Table) bool { return c.Name == t.Name })
	table := t.Name
	if opts.Archive {
		table = ArchiveTable(table)
	}
	return t, max(idx, 0), table, nil
}

// loadStoredIDs reads the identities the streams hold into a temporary
// table, not a map: a stream may hold many millions, and the join in the
// row query finds each row's streams. filter is a subject filter ("": all
// subjects); minCreated is the oldest row's created_at.
func loadStoredIDs(ctx context.Context, conn *pgx.Conn, bus busops.Bus, routes []relay.Route, filter string, minCreated *time.Time) error {
	from := time.Time{}
	if minCreated != nil {
		// Stored after the commit, which is after created_at; a minute of
		// slack for clocks.
		from = minCreated.Add(-time.Minute)
	}
	if _, err := conn.Exec(ctx, storedTableDDL); err != nil {
		return fmt.Errorf("create a temporary table for the stored ids (the role needs TEMP on the database; or pass --no-check to rely on the duplicate window alone): %w", err)
	}
	for _, rt := range routes {
		if rt.Stream == bus.DLQName() {
			continue
		}
		if err := storeIDs(ctx, conn, bus, rt.Stream, filter, from); err != nil {
			t := bus.Terms()
			return fmt.Errorf("read back %s %s (%s): %w", t.Stream, rt.Stream, t.NoCheck, err)
		}
	}
	if _, err := conn.Exec(ctx, `CREATE INDEX ON walbox_replay_stored (id); ANALYZE walbox_replay_stored`); err != nil {
		return fmt.Errorf("index the stored ids: %w", err)
	}
	return nil
}

// storedTableDDL is the temporary table of the identities the streams
// (topics) hold: stream, Walbox-Source, Walbox-Table and the bare event id.
const storedTableDDL = `CREATE TEMP TABLE walbox_replay_stored (stream text NOT NULL, source text NOT NULL, tbl text NOT NULL, id text NOT NULL)`

// replayRows publishes the selected rows in order: each through the
// router as an event of table idx, a poison one as a dead letter, one
// already stored skipped.
func replayRows(ctx context.Context, conn *pgx.Conn, q *rowQuery, bus busops.Bus, router *relay.Router, idx int, opts ReplayOptions, res *ReplayResult) error {
	suffix := ""
	if opts.ForceNewID {
		suffix = ".replay." + strconv.FormatInt(time.Now().UnixNano(), 10)
		res.NewIDSuffix = suffix
	}
	bar := newProgress(opts.Progress, opts.TTY, "replay", res.Rows, func() string {
		return fmt.Sprintf("published %d, skipped %d, duplicates %d, dead-lettered %d", res.Published, res.AlreadyStored, res.Duplicates, res.DeadLettered)
	})
	defer bar.finish()
	w := &ackWindow{res: res}
	publish := func(m *relay.Msg, stream string, dlq bool) error {
		if opts.DryRun {
			return nil
		}
		f, err := bus.Publish(m, stream)
		if err != nil {
			return fmt.Errorf("publish to %s: %w", m.Subject, err)
		}
		return w.add(ctx, flight{f: f, id: m.Header.Get(relay.HeaderMsgID), dlq: dlq})
	}

	rows, err := conn.Query(ctx, q.selectSQL, q.args...)
	if err != nil {
		return fmt.Errorf("read %s: %w", res.Table, err)
	}
	defer rows.Close()
	var index uint32
	for rows.Next() {
		ev, createdAt, storedIn, err := q.scan(rows)
		if err != nil {
			return err
		}
		bar.add(1)
		if opts.Topic != "" && (ev.TopicNull || !relay.SubjectMatches(opts.Topic, ev.Topic)) {
			continue
		}
		res.Events++
		ev.Table = idx
		ev.Pos = cdc.Position{CommitLSN: 0, Index: index}
		index++
		// The commit time is not kept with the row: created_at is the
		// closest (the header is the event's time, not the replay's).
		ev.CommitTime = createdAt
		if ev.CommitTime.IsZero() {
			ev.CommitTime = time.Now()
		}
		m, stream, err := router.Message(&ev)
		var pe *relay.PoisonError
		if errors.As(err, &pe) {
			res.DeadLettered++
			res.ByStream[bus.DLQName()]++
			if err := publish(bus.DeadLetter(router, &ev, pe.Reason), bus.DLQName(), true); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return err
		}
		if opts.ForceNewID {
			// The dedupe key (qualified for a table after the first) and
			// the bare id, both new.
			m.Qualify(m.Header.Get(relay.HeaderMsgID)+suffix, ev.ID+suffix)
			m.Header.Set(HeaderReplayOf, ev.ID)
		} else if slices.Contains(storedIn, stream) {
			res.AlreadyStored++
			continue
		}
		res.ByStream[stream]++
		if opts.DryRun {
			res.Published++
			continue
		}
		if err := publish(m, stream, false); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read %s: %w", res.Table, err)
	}
	return w.flush(ctx)
}

// flight is a publish that waits for its ack.
type flight struct {
	f   relay.Future
	id  string
	dlq bool // counted as dead-lettered already
}

// ackWindow holds the publishes that wait for their acks, at most
// replayWindow: one more waits for the oldest first. An ack counts in
// res.
type ackWindow struct {
	res      *ReplayResult
	inflight []flight
}

func (w *ackWindow) add(ctx context.Context, fl flight) error {
	w.inflight = append(w.inflight, fl)
	if len(w.inflight) >= replayWindow {
		if err := w.wait(ctx, w.inflight[0]); err != nil {
			return err
		}
		w.inflight = w.inflight[1:]
	}
	return nil
}

// flush waits for every ack.
func (w *ackWindow) flush(ctx context.Context) error {
	for _, fl := range w.inflight {
		if err := w.wait(ctx, fl); err != nil {
			return err
		}
	}
	w.inflight = nil
	return nil
}

func (w *ackWindow) wait(ctx context.Context, fl flight) error {
	ack, err := relay.Await(ctx, fl.f)
	switch {
	case err != nil && ctx.Err() != nil:
		return err
	case err != nil:
		return fmt.Errorf("publish %s: %w", fl.id, err)
	case fl.dlq:
	case ack.Duplicate:
		w.res.Duplicates++
	default:
		w.res.Published++
	}
	return nil
}

// rowQuery is the SELECT of a replay: the role columns the table has,
// filtered and ordered.
type rowQuery struct {
	selectSQL, countSQL string
	args, countArgs     []any
	roles               []cdc.Role
	payloadIsJSON       bool
	hasCreated          bool // the last column is created_at as timestamptz
	// checkStored: a last column lists the streams that hold the row's id
	// (from walbox_replay_stored).
	checkStored bool
}

func newRowQuery(ctx context.Context, conn *pgx.Conn, table cdc.TableName, cols cdc.Columns, opts ReplayOptions, owner storedOwner) (*rowQuery, error) {
	rows, err := conn.Query(ctx, `SELECT a.attname, format_type(a.atttypid, a.atttypmod) FROM pg_attribute a
		WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped`, table.Quoted())
	if err != nil {
		return nil, fmt.Errorf("read the columns of %s: %w", table, err)
	}
	types := map[string]string{}
	for rows.Next() {
		var n, t string
		if err := rows.Scan(&n, &t); err != nil {
			rows.Close()
			return nil, err
		}
		types[n] = t
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the columns of %s: %w", table, err)
	}
	if len(types) == 0 {
		hint := "check outbox.table"
		if opts.Archive {
			hint = "nothing has been archived yet"
		}
		return nil, fmt.Errorf("table %s does not exist (%s)", table, hint)
	}
	q := &rowQuery{}
	var sel []string
	for r, col := range cols {
		if _, ok := types[col]; col == "" || !ok {
			continue
		}
		sel = append(sel, cdc.QuoteIdent(col)+"::text")
		q.roles = append(q.roles, cdc.Role(r))
	}
	for _, need := range []cdc.Role{cdc.RoleID, cdc.RoleTopic, cdc.RolePayload} {
		if _, ok := types[cols[need]]; !ok {
			return nil, fmt.Errorf("table %s has no column %q (role %s; see outbox.columns)", table, cols[need], need)
		}
	}
	pt := types[cols[cdc.RolePayload]]
	q.payloadIsJSON = pt == "json" || pt == "jsonb"
	created := ""
	if c := cols[cdc.RoleCreatedAt]; c != "" && types[c] != "" {
		created = cdc.QuoteIdent(c)
	}
	var where []string
	if !opts.From.IsZero() || !opts.To.IsZero() {
		if created == "" {
			return nil, fmt.Errorf("table %s has no created_at column (outbox.columns.created_at): select by --id", table)
		}
	}
	if !opts.From.IsZero() {
		q.args = append(q.args, opts.From)
		where = append(where, fmt.Sprintf("%s >= $%d", created, len(q.args)))
	}
	if !opts.To.IsZero() {
		q.args = append(q.args, opts.To)
		where = append(where, fmt.Sprintf("%s < $%d", created, len(q.args)))
	}
	id := cdc.QuoteIdent(cols[cdc.RoleID])
	if len(opts.IDs) > 0 {
		q.args = append(q.args, opts.IDs)
		where = append(where, fmt.Sprintf("%s::text = ANY($%d)", id, len(q.args)))
	}
	w := ""
	if len(where) > 0 {
		w = " WHERE " + strings.Join(where, " AND ")
	}
	// Qualified: the select list has output columns of the same names.
	order := "o." + id
	minCreated := "NULL::timestamptz"
	if created != "" {
		order = "o." + created + ", o." + id
		minCreated = "min(" + created + ")"
	}
	if created != "" {
		q.hasCreated = true
		sel = append(sel, created+"::timestamptz")
	}
	q.countSQL = fmt.Sprintf("SELECT count(*), %s FROM %s%s", minCreated, table.Quoted(), w)
	// The count takes the selection's arguments; the select also the owner.
	q.countArgs = q.args
	if !opts.ForceNewID && !opts.NoCheck {
		q.checkStored = true
		q.args = append(slices.Clip(q.args), owner.source, owner.tables)
		sel = append(sel, fmt.Sprintf(`(SELECT array_agg(DISTINCT s.stream) FROM walbox_replay_stored s
			WHERE s.id = o.%s::text AND s.source IN ($%d, '') AND s.tbl = ANY($%d))`, id, len(q.args)-1, len(q.args)))
	}
	q.selectSQL = fmt.Sprintf("SELECT %s FROM %s o%s ORDER BY %s", strings.Join(sel, ", "), table.Quoted(), w, order)
	return q, nil
}

func (q *rowQuery) scan(rows pgx.Rows) (cdc.Event, time.Time, []string, error) {
	vals := make([]*string, len(q.roles))
	ptrs := make([]any, len(q.roles), len(q.roles)+2)
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	var created *time.Time
	if q.hasCreated {
		ptrs = append(ptrs, &created)
	}
	var storedIn []string
	if q.checkStored {
		ptrs = append(ptrs, &storedIn)
	}
	if err := rows.Scan(ptrs...); err != nil {
		return cdc.Event{}, time.Time{}, nil, fmt.Errorf("read a row: %w", err)
	}
	ev := cdc.Event{PayloadIsJSON: q.payloadIsJSON, TopicNull: true}
	for i, r := range q.roles {
		v := vals[i]
		if v == nil {
			if r == cdc.RolePayload {
				ev.PayloadNull = true
			}
			continue
		}
		switch r {
		case cdc.RoleID:
			ev.ID = *v
		case cdc.RoleTopic:
			ev.Topic, ev.TopicNull = *v, false
		case cdc.RolePayload:
			ev.Payload = []byte(*v)
		case cdc.RoleStream:
			ev.Stream = *v
		case cdc.RoleEventType:
			ev.EventType = *v
		case cdc.RoleAggregateType:
			ev.AggregateType = *v
		case cdc.RoleAggregateID:
			ev.AggregateID = *v
		case cdc.RolePartitionKey:
			ev.PartitionKey = *v
		case cdc.RoleHeaders:
			ev.Headers = []byte(*v)
		case cdc.RoleCreatedAt:
			ev.CreatedAt = *v
		}
	}
	if created != nil {
		return ev, *created, storedIn, nil
	}
	return ev, time.Time{}, storedIn, nil
}

// storeIDs reads the identity (source, table, bare event id) of every
// message of stream stored since from (zero: all), under filter ("" for
// all subjects), headers only, and copies them into walbox_replay_stored
// in batches: memory stays flat however many the stream holds.
func storeIDs(ctx context.Context, conn *pgx.Conn, bus busops.Bus, stream, filter string, from time.Time) error {
	c := idCopier{conn: conn}
	if err := bus.Scan(ctx, stream, filter, from, func(h relay.Header) error { return c.add(ctx, stream, h) }); err != nil {
		return err
	}
	return c.flush(ctx)
}

// idCopier copies (stream, source, table, id) rows into
// walbox_replay_stored in batches.
type idCopier struct {
	conn  *pgx.Conn
	batch [][]any
}

// add copies the identity of a stored message with headers h (the bare
// id: Walbox-Event-Id where set, else Nats-Msg-Id); one without an id is
// skipped.
func (c *idCopier) add(ctx context.Context, stream string, h relay.Header) error {
	id := relay.IdentityID(h)
	if id == "" {
		return nil
	}
	c.batch = append(c.batch, []any{stream, h.Get(relay.HeaderSource), h.Get(relay.HeaderTable), id})
	if len(c.batch) >= 10000 {
		return c.flush(ctx)
	}
	return nil
}

func (c *idCopier) flush(ctx context.Context) error {
	if len(c.batch) == 0 {
		return nil
	}
	_, err := c.conn.CopyFrom(ctx, pgx.Identifier{"walbox_replay_stored"}, []string{"stream", "source", "tbl", "id"}, pgx.CopyFromRows(c.batch))
	c.batch = c.batch[:0]
	if err != nil {
		return fmt.Errorf("copy stored ids: %w", err)
	}
	return nil
}
