// Package outboxtest holds what walbox's fault tests share: a load of
// concurrent producers, an independent witness of commit order, and the one
// checker that judges every run (lost, duplicated, out of order, from a
// rolled-back transaction).
package outboxtest

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// Report is the checker's verdict. Any non-zero count but Checked fails.
type Report struct {
	Checked        int // committed events looked for
	Lost           int
	Duplicated     int
	OutOfOrder     int
	FromRolledBack int
	Examples       []string
	// Snapshot and SnapshotOutOfOrder: see CheckStreamed.
	Snapshot           int
	SnapshotOutOfOrder int
}

// OK reports whether the run kept every guarantee.
func (r Report) OK() bool {
	return r.Lost == 0 && r.Duplicated == 0 && r.OutOfOrder == 0 && r.FromRolledBack == 0
}

func (r Report) String() string {
	s := fmt.Sprintf("checked=%d lost=%d duplicated=%d out_of_order=%d from_rolled_back=%d",
		r.Checked, r.Lost, r.Duplicated, r.OutOfOrder, r.FromRolledBack)
	if r.Snapshot > 0 {
		s += fmt.Sprintf(" (from snapshots: %d events, %d out of commit order)", r.Snapshot, r.SnapshotOutOfOrder)
	}
	if len(r.Examples) > 0 {
		s += "\n  " + strings.Join(r.Examples, "\n  ")
	}
	return s
}

func (r *Report) example(format string, args ...any) {
	if len(r.Examples) < 10 {
		r.Examples = append(r.Examples, fmt.Sprintf(format, args...))
	}
}

// Check judges a run. committed lists the committed event ids in commit order
// (from the witness slot); rolledBack the ids of rolled-back inserts;
// streams the ids each stream holds, in stream order. Events may sit in any
// stream (routing is the relay's business), but each committed id must be
// stored exactly once, and within a stream ids must follow commit order.
func Check(committed, rolledBack []string, streams map[string][]string) Report {
	rep := Report{Checked: len(committed)}
	order := make(map[string]int, len(committed))
	for i, id := range committed {
		order[id] = i
	}
	rb := make(map[string]bool, len(rolledBack))
	for _, id := range rolledBack {
		rb[id] = true
	}
	seen := make(map[string]int, len(committed))
	names := make([]string, 0, len(streams))
	for name := range streams {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		last := -1
		lastID := ""
		for _, id := range streams[name] {
			seen[id]++
			if seen[id] == 2 {
				rep.Duplicated++
				rep.example("duplicated: %s in %s", id, name)
			}
			if rb[id] {
				rep.FromRolledBack++
				rep.example("from a rolled-back transaction: %s in %s", id, name)
				continue
			}
			pos, ok := order[id]
			if !ok {
				continue // not an event of this run (e.g. a fixture)
			}
			if pos < last {
				rep.OutOfOrder++
				rep.example("out of order in %s: %s (commit #%d) after %s (commit #%d)", name, id, pos, lastID, last)
			} else {
				last, lastID = pos, id
			}
		}
	}
	for _, id := range committed {
		if seen[id] == 0 {
			rep.Lost++
			rep.example("lost: %s", id)
		}
	}
	return rep
}

// Witness is an independent record of commit order: a test_decoding slot
// created before the load, read after it. It does not share code with walbox.
type Witness struct {
	Slot  string
	Table string // unqualified table name to filter
	// IDColumn is the id column's name (default "id").
	IDColumn string
}

// CreateWitness creates the witness slot. Call before producing.
func CreateWitness(ctx context.Context, conn *pgx.Conn, slot, table string) (*Witness, error) {
	if _, err := conn.Exec(ctx, "SELECT pg_create_logical_replication_slot($1, 'test_decoding')", slot); err != nil {
		return nil, fmt.Errorf("create witness slot: %w", err)
	}
	return &Witness{Slot: slot, Table: table, IDColumn: "id"}, nil
}

// Committed reads every committed insert into the table since the witness was
// created, in commit order (and insert order within a transaction).
func (w *Witness) Committed(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	col := w.IDColumn
	if col == "" {
		col = "id"
	}
	re := regexp.MustCompile(`^table [^.]+\.` + regexp.QuoteMeta(w.Table) + `(_\w+)?: INSERT: .*?\b` + regexp.QuoteMeta(col) + `\[[^\]]+\]:'([^']*)'`)
	rows, err := conn.Query(ctx, "SELECT data FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'include-xids', '0')", w.Slot)
	if err != nil {
		return nil, fmt.Errorf("read witness slot: %w", err)
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var line string
		if err := rows.Scan(&line); err != nil {
			return nil, err
		}
		if m := re.FindStringSubmatch(line); m != nil {
			ids = append(ids, m[2])
		}
	}
	return ids, rows.Err()
}

// ReadStream returns the Nats-Msg-Id of every message in a stream, in order.
func ReadStream(ctx context.Context, js jetstream.JetStream, stream string) ([]string, error) {
	ids, _, err := readStream(ctx, js, stream)
	return ids, err
}

// readStream also returns the ids of messages published from a snapshot
// (position header 0/0): they carry no WAL position.
func readStream(ctx context.Context, js jetstream.JetStream, stream string) ([]string, map[string]bool, error) {
	snap := map[string]bool{}
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, nil, fmt.Errorf("stream %s: %w", stream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("stream %s info: %w", stream, err)
	}
	last := info.State.LastSeq
	if info.State.Msgs == 0 {
		return nil, snap, nil
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		return nil, nil, fmt.Errorf("ordered consumer on %s: %w", stream, err)
	}
	var ids []string
	for {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			return nil, nil, fmt.Errorf("fetch from %s: %w", stream, err)
		}
		n := 0
		var seq uint64
		for msg := range batch.Messages() {
			n++
			ids = append(ids, msg.Headers().Get("Nats-Msg-Id"))
			if msg.Headers().Get("Walbox-Commit-Lsn") == "0/0" {
				snap[msg.Headers().Get("Nats-Msg-Id")] = true
			}
			md, err := msg.Metadata()
			if err == nil {
				seq = md.Sequence.Stream
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) {
			return nil, nil, fmt.Errorf("fetch from %s: %w", stream, err)
		}
		if seq >= last {
			return ids, snap, nil
		}
		if n == 0 && ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
	}
}

// ReadStreams reads several streams.
func ReadStreams(ctx context.Context, js jetstream.JetStream, names ...string) (map[string][]string, error) {
	out := map[string][]string{}
	for _, n := range names {
		ids, err := ReadStream(ctx, js, n)
		if err != nil {
			return nil, err
		}
		out[n] = ids
	}
	return out, nil
}

// ReadStreamsSnapshot reads several streams and returns, besides the ids, the
// set of ids published from a snapshot (backfill after a slot was created).
func ReadStreamsSnapshot(ctx context.Context, js jetstream.JetStream, names ...string) (map[string][]string, map[string]bool, error) {
	out := map[string][]string{}
	snap := map[string]bool{}
	for _, n := range names {
		var ids []string
		var sn map[string]bool
		var err error
		// A cluster that just lost a node may answer "no responders" for
		// a moment; the stream is still there.
		for attempt := 0; attempt < 20; attempt++ {
			if ids, sn, err = readStream(ctx, js, n); err == nil {
				break
			}
			time.Sleep(500 * time.Millisecond)
		}
		if err != nil {
			return nil, nil, err
		}
		out[n] = ids
		for id := range sn {
			snap[id] = true
		}
	}
	return out, snap, nil
}

// CheckStreamed is Check with one documented exception: events published
// from a snapshot (after a slot was created or recreated) have no WAL
// position, so their order can only follow commit timestamps. Their order
// is counted apart, in SnapshotOutOfOrder, and does not fail the run; lost,
// duplicated and rolled-back events count as always.
func CheckStreamed(committed, rolledBack []string, streams map[string][]string, snapshot map[string]bool) Report {
	filtered := make(map[string][]string, len(streams))
	for name, ids := range streams {
		var keep []string
		for _, id := range ids {
			if !snapshot[id] {
				keep = append(keep, id)
			}
		}
		filtered[name] = keep
	}
	full := Check(committed, rolledBack, streams)
	streamed := Check(committed, rolledBack, filtered)
	full.SnapshotOutOfOrder = full.OutOfOrder - streamed.OutOfOrder
	if full.SnapshotOutOfOrder < 0 {
		full.SnapshotOutOfOrder = 0
	}
	full.OutOfOrder = streamed.OutOfOrder
	full.Snapshot = len(snapshot)
	return full
}
