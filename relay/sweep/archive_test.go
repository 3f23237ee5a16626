package sweep_test

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay/sweep"
)

const day = 24 * time.Hour

func archiving(after time.Duration) func(*sweep.Config) {
	return func(c *sweep.Config) { c.Archive.After = after }
}

func exporting(store sweep.ColdStore, after, exportAfter, deleteAfter time.Duration) func(*sweep.Config) {
	return func(c *sweep.Config) {
		c.Archive = sweep.ArchiveConfig{After: after, ExportAfter: exportAfter, DeleteAfter: deleteAfter, Store: store}
	}
}

func (d *db) parentOf(table string) string {
	d.t.Helper()
	var parent string
	if err := d.pool.QueryRow(context.Background(), `SELECT coalesce((SELECT inhparent::regclass::text FROM pg_inherits WHERE inhrelid = to_regclass($1)), '')`, table).Scan(&parent); err != nil {
		d.t.Fatal(err)
	}
	return parent
}

func (d *db) journalState(partition string) string {
	d.t.Helper()
	var st string
	if err := d.pool.QueryRow(context.Background(), `SELECT coalesce((SELECT state FROM walbox.archive_partitions WHERE partition_name = $1), '')`, partition).Scan(&st); err != nil {
		d.t.Fatal(err)
	}
	return st
}

func maintain(t *testing.T, sw *sweep.Sweeper, opts ...sweep.MaintainOptions) *sweep.Report {
	t.Helper()
	var o sweep.MaintainOptions
	if len(opts) > 0 {
		o = opts[0]
	}
	rep, err := sw.Maintain(context.Background(), o)
	if err != nil {
		t.Fatalf("maintain: %v (report %+v)", err, rep)
	}
	return rep
}

func TestArchiveMovesProcessedPartitionsAndReportsBlocked(t *testing.T) {
	d := newDB(t, true)
	done := d.oldPartition(100, 1000, true)
	blocked := d.oldPartition(101, 10, true)
	d.exec(`UPDATE ` + blocked + ` SET processed = false WHERE payload->>'n' = '3'`)
	recent := d.oldPartition(10, 10, true)
	sw := d.sweeper(archiving(90 * day))

	dry := maintain(t, sw, sweep.MaintainOptions{DryRun: true})
	if len(dry.Archived) != 1 || dry.Archived[0] != done || len(dry.Blocked) != 1 || dry.Blocked[0].Partition != blocked {
		t.Fatalf("dry run: archive %v, blocked %+v; want [%s] and %s", dry.Archived, dry.Blocked, done, blocked)
	}
	if d.parentOf(done) != "outbox_events" {
		t.Fatal("the dry run moved a partition")
	}

	rep := maintain(t, sw)
	if len(rep.Archived) != 1 || rep.Archived[0] != done {
		t.Fatalf("archived %v, want [%s]", rep.Archived, done)
	}
	if len(rep.Blocked) != 1 || rep.Blocked[0] != (sweep.Blocked{Partition: blocked, Unprocessed: 1}) {
		t.Fatalf("blocked %+v, want %s with 1 unprocessed row", rep.Blocked, blocked)
	}
	if p := d.parentOf(done); p != "walbox.outbox_events_archive" {
		t.Fatalf("%s is attached to %q, want the archive", done, p)
	}
	if p := d.parentOf(blocked); p != "outbox_events" {
		t.Fatalf("blocked %s moved to %q", blocked, p)
	}
	if p := d.parentOf(recent); p != "outbox_events" {
		t.Fatalf("recent %s moved to %q", recent, p)
	}
	if n := d.int(`SELECT count(*) FROM walbox.outbox_events_archive`); n != 1000 {
		t.Fatalf("archive holds %d rows, want 1000", n)
	}
	if st := d.journalState(done); st != "archived" {
		t.Fatalf("journal says %q", st)
	}
	m := sw.Metrics()
	if testutil.ToFloat64(m.Archived) != 1 || testutil.ToFloat64(m.Blocked) != 1 {
		t.Errorf("metrics: archived %v, blocked %v; want 1 and 1", testutil.ToFloat64(m.Archived), testutil.ToFloat64(m.Blocked))
	}

	// Once marked, the blocked partition goes too; nothing is done twice.
	d.exec(`UPDATE ` + blocked + ` SET processed = true`)
	rep = maintain(t, sw)
	if len(rep.Archived) != 1 || rep.Archived[0] != blocked || len(rep.Blocked) != 0 {
		t.Fatalf("second run: archived %v, blocked %+v", rep.Archived, rep.Blocked)
	}
	if testutil.ToFloat64(m.Blocked) != 0 {
		t.Error("blocked gauge not cleared")
	}
	if rep := maintain(t, sw); !rep.Empty() {
		t.Fatalf("third run did something: %+v", rep)
	}
}

func TestArchiveResumesAfterCrashBetweenDetachAndAttach(t *testing.T) {
	d := newDB(t, true)
	part := d.oldPartition(100, 100, true)
	sw := d.sweeper(archiving(90 * day))
	errCrash := errors.New("crash")
	sweep.SetCrashAt(func(step string) error {
		if step == "detached" {
			return errCrash
		}
		return nil
	})
	defer sweep.SetCrashAt(nil)
	if _, err := sw.Maintain(context.Background(), sweep.MaintainOptions{}); !errors.Is(err, errCrash) {
		t.Fatalf("maintain: %v, want the crash", err)
	}
	if p := d.parentOf(part); p != "" {
		t.Fatalf("after the crash %s is attached to %q, want detached", part, p)
	}
	if st := d.journalState(part); st != "detached" {
		t.Fatalf("journal says %q, want detached", st)
	}
	st, err := sw.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Archive.Pending) != 1 {
		t.Errorf("status pending %v", st.Archive.Pending)
	}

	sweep.SetCrashAt(nil)
	rep := maintain(t, sw)
	if len(rep.Resumed) != 1 || rep.Resumed[0] != part {
		t.Fatalf("resumed %v, want [%s]", rep.Resumed, part)
	}
	if p := d.parentOf(part); p != "walbox.outbox_events_archive" {
		t.Fatalf("%s attached to %q after the re-run", part, p)
	}
	if n := d.int(`SELECT count(*) FROM walbox.outbox_events_archive`); n != 100 {
		t.Fatalf("archive holds %d rows", n)
	}
}

// countingStore counts uploads per key on top of a real store.
type countingStore struct {
	sweep.ColdStore
	mu   sync.Mutex
	puts map[string]int
}

func (c *countingStore) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	c.mu.Lock()
	if c.puts == nil {
		c.puts = map[string]int{}
	}
	c.puts[key]++
	c.mu.Unlock()
	return c.ColdStore.Put(ctx, key, r, size)
}

// checkExport reads an export back from the store and checks it against
// its manifest and the rows it came from.
func checkExport(t *testing.T, store sweep.ColdStore, dataKey string, want map[string]string) sweep.Manifest {
	t.Helper()
	ctx := context.Background()
	raw, err := store.Get(ctx, strings.TrimSuffix(dataKey, ".jsonl.gz")+".manifest.json")
	if err != nil {
		t.Fatalf("manifest: %v", err)
	}
	var man sweep.Manifest
	if err := json.Unmarshal(raw, &man); err != nil {
		t.Fatal(err)
	}
	data, err := store.Get(ctx, dataKey)
	if err != nil {
		t.Fatalf("data: %v", err)
	}
	sum := sha256.Sum256(data)
	if hex.EncodeToString(sum[:]) != man.SHA256 || int64(len(data)) != man.Bytes {
		t.Fatalf("object does not match its manifest (sha256, bytes)")
	}
	zr, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(zr)
	sc.Buffer(nil, 1<<20)
	var n int64
	var minC, maxC time.Time
	for sc.Scan() {
		var row struct {
			ID        string          `json:"id"`
			CreatedAt time.Time       `json:"created_at"`
			Payload   json.RawMessage `json:"payload"`
			Processed bool            `json:"processed"`
		}
		if err := json.Unmarshal(sc.Bytes(), &row); err != nil {
			t.Fatalf("line %d is not JSON: %v: %s", n+1, err, sc.Text())
		}
		if w, ok := want[row.ID]; !ok {
			t.Fatalf("exported row %s is not from the partition", row.ID)
		} else {
			var a, b any
			json.Unmarshal([]byte(w), &a)
			json.Unmarshal(row.Payload, &b)
			ja, _ := json.Marshal(a)
			jb, _ := json.Marshal(b)
			if !bytes.Equal(ja, jb) {
				t.Fatalf("row %s payload %s, want %s", row.ID, row.Payload, w)
			}
		}
		if !row.Processed {
			t.Fatalf("row %s exported unprocessed", row.ID)
		}
		if n == 0 || row.CreatedAt.Before(minC) {
			minC = row.CreatedAt
		}
		if row.CreatedAt.After(maxC) {
			maxC = row.CreatedAt
		}
		n++
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if n != int64(len(want)) || man.Rows != n {
		t.Fatalf("export has %d lines, manifest says %d, want %d", n, man.Rows, len(want))
	}
	if man.MinCreatedAt == nil || !man.MinCreatedAt.Equal(minC) || !man.MaxCreatedAt.Equal(maxC) {
		t.Fatalf("manifest min/max %v/%v, rows say %v/%v", man.MinCreatedAt, man.MaxCreatedAt, minC, maxC)
	}
	return man
}

// exportDir is the key prefix of d's exports: its system identifier and
// database name.
func (d *db) exportDir() string {
	d.t.Helper()
	return queryOne[string](d, `SELECT system_identifier::text || '/' || current_database() FROM pg_control_system()`)
}

func (d *db) payloads(table string) map[string]string {
	d.t.Helper()
	rows, err := d.pool.Query(context.Background(), `SELECT id::text, payload::text FROM `+table)
	if err != nil {
		d.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var id, p string
		rows.Scan(&id, &p)
		out[id] = p
	}
	return out
}

func testExportAndDelete(t *testing.T, store sweep.ColdStore) {
	d := newDB(t, true)
	part := d.oldPartition(10, 500, true)
	want := d.payloads(part)
	name := strings.TrimPrefix(part, "public.")
	dataKey := d.exportDir() + "/outbox_events/" + name + ".jsonl.gz"
	sw := d.sweeper(exporting(store, 1*day, 2*day, 0))

	dry := maintain(t, sw, sweep.MaintainOptions{DryRun: true})
	if len(dry.Archived) != 1 || len(dry.Exported) != 0 {
		// export is decided from the journal, after archival: a dry run
		// before the first archival only shows the archival.
		t.Fatalf("dry run: %+v", dry)
	}
	rep := maintain(t, sw)
	if len(rep.Archived) != 1 || len(rep.Exported) != 1 {
		t.Fatalf("archived %v, exported %+v; want one each", rep.Archived, rep.Exported)
	}
	if e := rep.Exported[0]; e.Object != dataKey || e.Rows != 500 || e.Resumed {
		t.Fatalf("export %+v, want %s with 500 rows", e, dataKey)
	}
	checkExport(t, store, dataKey, want)
	if d.bool(`SELECT to_regclass($1) IS NOT NULL`, part) {
		t.Fatal("exported partition not dropped")
	}
	if st := d.journalState(part); st != "exported" {
		t.Fatalf("journal %q", st)
	}
	m := sw.Metrics()
	if testutil.ToFloat64(m.Exported) != 1 || testutil.ToFloat64(m.RowsExported) != 500 {
		t.Errorf("metrics exported %v rows %v", testutil.ToFloat64(m.Exported), testutil.ToFloat64(m.RowsExported))
	}
	if rep := maintain(t, sw); !rep.Empty() {
		t.Fatalf("second run did something: %+v", rep)
	}

	// Past the retention age (the rows are 10 days old, delete after 3).
	sw2 := d.sweeper(exporting(store, 1*day, 2*day, 3*day))
	dry = maintain(t, sw2, sweep.MaintainOptions{DryRun: true})
	if len(dry.Deleted) != 1 {
		t.Fatalf("dry run would delete %v", dry.Deleted)
	}
	rep = maintain(t, sw2)
	if len(rep.Deleted) != 1 || rep.Deleted[0] != dataKey {
		t.Fatalf("deleted %v, want [%s]", rep.Deleted, dataKey)
	}
	keys, err := store.List(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(keys) != 0 {
		t.Fatalf("store still holds %v", keys)
	}
	if st := d.journalState(part); st != "deleted" {
		t.Fatalf("journal %q", st)
	}
}

func TestExportToDirectoryAndDelete(t *testing.T) {
	store, err := sweep.NewDirStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	testExportAndDelete(t, store)
}

// fakeS3 runs a real S3-protocol server (gofakes3, in memory) and returns a
// store on a bucket in it.
func fakeS3(t *testing.T, prefix string) *sweep.S3Store {
	t.Helper()
	backend := s3mem.New()
	srv := httptest.NewServer(gofakes3.New(backend).Server())
	t.Cleanup(srv.Close)
	if err := backend.CreateBucket("archive"); err != nil {
		t.Fatal(err)
	}
	store, err := sweep.NewS3Store(sweep.S3Config{Endpoint: strings.TrimPrefix(srv.URL, "http://"), Bucket: "archive", Prefix: prefix,
		AccessKey: "walbox", SecretKey: "secret", UseSSL: false})
	if err != nil {
		t.Fatal(err)
	}
	return store
}

func TestExportToS3AndDelete(t *testing.T) {
	testExportAndDelete(t, fakeS3(t, "walbox/prod"))
}

// A crash after the upload and before the drop: the next run finds the
// manifest, does not upload again, and drops. A crash after the data
// object and before the manifest: the next run exports again to the same
// key (one object, replaced).
func TestExportResumesAfterCrashBetweenExportAndDrop(t *testing.T) {
	for _, step := range []string{"exported", "uploaded-data"} {
		t.Run(step, func(t *testing.T) {
			d := newDB(t, true)
			part := d.oldPartition(10, 300, true)
			want := d.payloads(part)
			store := &countingStore{ColdStore: fakeS3(t, "")}
			sw := d.sweeper(exporting(store, 1*day, 2*day, 0))
			errCrash := errors.New("crash")
			sweep.SetCrashAt(func(s string) error {
				if s == step {
					return errCrash
				}
				return nil
			})
			defer sweep.SetCrashAt(nil)
			if _, err := sw.Maintain(context.Background(), sweep.MaintainOptions{}); !errors.Is(err, errCrash) {
				t.Fatalf("maintain: %v, want the crash", err)
			}
			if !d.bool(`SELECT to_regclass($1) IS NOT NULL`, part) || d.journalState(part) != "archived" {
				t.Fatalf("after the crash: table gone or journal %q", d.journalState(part))
			}
			sweep.SetCrashAt(nil)
			rep := maintain(t, sw)
			if len(rep.Exported) != 1 || rep.Exported[0].Resumed != (step == "exported") {
				t.Fatalf("exported %+v", rep.Exported)
			}
			dataKey := rep.Exported[0].Object
			checkExport(t, store, dataKey, want)
			wantPuts := 1
			if step == "uploaded-data" {
				wantPuts = 2 // exported again to the same key
			}
			if store.puts[dataKey] != wantPuts {
				t.Errorf("data object uploaded %d times, want %d", store.puts[dataKey], wantPuts)
			}
			keys, _ := store.List(context.Background(), "")
			if len(keys) != 2 {
				t.Errorf("store holds %v, want the object and its manifest", keys)
			}
			if d.bool(`SELECT to_regclass($1) IS NOT NULL`, part) || d.journalState(part) != "exported" {
				t.Fatal("not dropped after the re-run")
			}
		})
	}
}

// An unpartitioned table (the DAARION layout) is archived row by row in
// bounded batches.
func TestArchiveUnpartitionedInBatches(t *testing.T) {
	d := newDB(t, false)
	d.exec(`CREATE TABLE daarion_outbox (id text PRIMARY KEY, stream text, topic text, payload jsonb,
		created_at timestamptz NOT NULL DEFAULT now(), processed boolean NOT NULL DEFAULT false, processed_at timestamptz, error text)`)
	d.exec(`INSERT INTO daarion_outbox (id, topic, payload, created_at, processed)
		SELECT 'old-' || g, 'orders.x', '{}', now() - interval '100 days' + g * interval '1 second', true FROM generate_series(1, 2500) g`)
	d.exec(`INSERT INTO daarion_outbox (id, topic, payload, created_at, processed)
		SELECT 'stuck-' || g, 'orders.x', '{}', now() - interval '100 days', false FROM generate_series(1, 10) g`)
	d.exec(`INSERT INTO daarion_outbox (id, topic, payload, processed) SELECT 'new-' || g, 'orders.x', '{}', true FROM generate_series(1, 100) g`)
	cols := cdc.DefaultColumns()
	for _, r := range []cdc.Role{cdc.RoleEventType, cdc.RoleAggregateType, cdc.RoleAggregateID, cdc.RolePartitionKey, cdc.RoleHeaders} {
		cols[r] = ""
	}
	sw := d.sweeper(archiving(90*day), func(c *sweep.Config) {
		c.Table = cdc.TableName{Schema: "public", Name: "daarion_outbox"}
		c.Columns = cols
		c.Archive.RowBatch = 1000
	})
	dry := maintain(t, sw, sweep.MaintainOptions{DryRun: true})
	if dry.RowsArchived != 2500 {
		t.Fatalf("dry run would archive %d rows", dry.RowsArchived)
	}
	rep := maintain(t, sw)
	if rep.RowsArchived != 2500 {
		t.Fatalf("archived %d rows, want 2500", rep.RowsArchived)
	}
	if len(rep.Blocked) != 1 || rep.Blocked[0].Unprocessed != 10 {
		t.Fatalf("blocked %+v, want the 10 stuck rows", rep.Blocked)
	}
	if n := d.int(`SELECT count(*) FROM walbox.daarion_outbox_archive WHERE id LIKE 'old-%'`); n != 2500 {
		t.Fatalf("archive holds %d rows", n)
	}
	if n := d.int(`SELECT count(*) FROM daarion_outbox`); n != 110 {
		t.Fatalf("outbox holds %d rows, want 110", n)
	}
	if rep := maintain(t, sw); rep.RowsArchived != 0 {
		t.Fatalf("second run archived %d", rep.RowsArchived)
	}
}

func TestStatus(t *testing.T) {
	d := newDB(t, true)
	d.oldPartition(100, 20, true)
	blocked := d.oldPartition(101, 5, false)
	d.exec(`CREATE TABLE outbox_events_default PARTITION OF outbox_events DEFAULT`) // as an older walbox made it
	d.exec(`INSERT INTO outbox_events (topic, payload, created_at) VALUES ('orders.x', '{}', now() + interval '60 days')`)
	d.exec(`INSERT INTO outbox_events (topic, payload, error, attempts) VALUES ('bad', '{}', 'no stream', 1)`)
	sw := d.sweeper(archiving(90 * day))
	st, err := sw.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !st.Partitioned || !st.HasProcessed || st.Unprocessed != 7 || st.DeadLettered != 1 || st.DefaultRows != 1 {
		t.Fatalf("status %+v", st)
	}
	if st.OldestUnprocessed < 100*day {
		t.Errorf("oldest unprocessed %v, want over 100 days", st.OldestUnprocessed)
	}
	if len(st.Archive.Blocked) != 1 || st.Archive.Blocked[0].Partition != blocked || len(st.Archive.Partitions) != 0 {
		t.Errorf("archive status %+v", st.Archive)
	}
	last := st.Partitions[len(st.Partitions)-1]
	if !last.Default || st.Partitions[0].To.After(time.Now().Add(-99*day)) {
		t.Errorf("partitions not in range order with the default last: first %+v, last %+v", st.Partitions[0], last)
	}
	maintain(t, sw)
	st, err = sw.Status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if !st.Archive.Exists || len(st.Archive.Partitions) != 1 || st.DefaultRows != 0 {
		t.Errorf("after maintenance: %+v", st)
	}
}

func TestColdStores(t *testing.T) {
	dir, err := sweep.NewDirStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	for name, store := range map[string]sweep.ColdStore{"dir": dir, "s3": fakeS3(t, "p/q")} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			if _, err := store.Get(ctx, "a/missing.json"); !errors.Is(err, sweep.ErrNotExist) {
				t.Fatalf("get missing: %v", err)
			}
			for _, k := range []string{"t/x.json", "t/y.jsonl.gz", "u/z.json"} {
				if err := store.Put(ctx, k, strings.NewReader("v:"+k), int64(len("v:"+k))); err != nil {
					t.Fatal(err)
				}
			}
			if err := store.Put(ctx, "t/x.json", strings.NewReader("new"), 3); err != nil {
				t.Fatal(err)
			}
			b, err := store.Get(ctx, "t/x.json")
			if err != nil || string(b) != "new" {
				t.Fatalf("get: %q %v", b, err)
			}
			keys, err := store.List(ctx, "t/")
			if err != nil || strings.Join(keys, ",") != "t/x.json,t/y.jsonl.gz" {
				t.Fatalf("list: %v %v", keys, err)
			}
			if err := store.Delete(ctx, "t/x.json"); err != nil {
				t.Fatal(err)
			}
			if err := store.Delete(ctx, "t/x.json"); err != nil {
				t.Fatalf("deleting twice: %v", err)
			}
			keys, _ = store.List(ctx, "")
			if strings.Join(keys, ",") != "t/y.jsonl.gz,u/z.json" {
				t.Fatalf("after delete: %v", keys)
			}
		})
	}
}
