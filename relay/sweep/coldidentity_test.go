package sweep_test

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/walbox/walbox/relay/sweep"
)

// storeKeys lists every object of store.
func storeKeys(t *testing.T, store sweep.ColdStore) []string {
	t.Helper()
	keys, err := store.List(context.Background(), "")
	if err != nil {
		t.Fatal(err)
	}
	return keys
}

// Issue 34, item 9: two databases (here of one cluster: one system
// identifier, two database names) export a partition of the same name with
// the same number of rows into one store and prefix. Each must upload its
// own rows and delete only its own objects. Before the fix the second found
// the first's manifest at the same key, took it for its own (same row
// count), dropped its partition without uploading it, and its retention
// then deleted the first database's export.
func TestExportsOfTwoDatabasesSharingAStoreStayApart(t *testing.T) {
	store := &countingStore{ColdStore: fakeS3(t, "shared/prefix")}
	var dbs []*db
	var parts []string
	var wants []map[string]string
	for range 2 {
		d := newDB(t, true)
		part := d.oldPartition(10, 300, true)
		dbs, parts, wants = append(dbs, d), append(parts, part), append(wants, d.payloads(part))
	}
	if parts[0] != parts[1] {
		t.Fatalf("partitions %s and %s: the test wants one name", parts[0], parts[1])
	}
	var objects []string
	for i, d := range dbs {
		rep := maintain(t, d.sweeper(exporting(store, 1*day, 2*day, 0)))
		if len(rep.Exported) != 1 {
			t.Fatalf("database %d: exported %+v, want one partition", i, rep.Exported)
		}
		ex := rep.Exported[0]
		if ex.Resumed {
			t.Errorf("database %d took an export already in the store for its own and dropped %s without uploading it (object %s)", i, parts[i], ex.Object)
		}
		objects = append(objects, ex.Object)
	}
	if objects[0] == objects[1] {
		t.Errorf("both databases exported to %s", objects[0])
	}
	if keys := storeKeys(t, store); len(keys) != 4 {
		t.Errorf("store holds %v, want each database's object and manifest", keys)
	} else {
		for i := range dbs {
			checkExport(t, store, objects[i], wants[i])
		}
	}

	// The second database's retention (delete after 3 days; the rows are 10
	// days old) deletes its own export, not the first's.
	rep := maintain(t, dbs[1].sweeper(exporting(store, 1*day, 2*day, 3*day)))
	if len(rep.Deleted) != 1 || rep.Deleted[0] != objects[1] {
		t.Errorf("deleted %v, want the second database's export %s", rep.Deleted, objects[1])
	}
	keys := storeKeys(t, store)
	if len(keys) != 2 || !strings.Contains(strings.Join(keys, ","), objects[0]) {
		t.Errorf("after the second database's retention the store holds %v, want the first database's %s and its manifest", keys, objects[0])
	}
	if _, err := store.Get(context.Background(), objects[0]); err != nil {
		t.Fatalf("the first database's export is gone: %v", err)
	}
	// What is left is the first database's rows.
	checkExport(t, store, objects[0], wants[0])
}

func getManifest(t *testing.T, store sweep.ColdStore, key string) sweep.Manifest {
	t.Helper()
	raw, err := store.Get(context.Background(), key)
	if err != nil {
		t.Fatalf("manifest %s: %v", key, err)
	}
	var m sweep.Manifest
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func putManifest(t *testing.T, store sweep.ColdStore, key string, m sweep.Manifest) {
	t.Helper()
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Put(context.Background(), key, bytes.NewReader(b), int64(len(b))); err != nil {
		t.Fatal(err)
	}
}

// copyObject copies the object at from to to.
func copyObject(t *testing.T, store sweep.ColdStore, from, to string) {
	t.Helper()
	b, err := store.Get(context.Background(), from)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Put(context.Background(), to, bytes.NewReader(b), int64(len(b))); err != nil {
		t.Fatal(err)
	}
}

func sameManifest(a, b sweep.Manifest) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return bytes.Equal(ja, jb)
}

func manifestOf(data string) string { return strings.TrimSuffix(data, ".jsonl.gz") + ".manifest.json" }

// A manifest at a partition's own keys that is not that partition's export
// never makes walbox drop the partition or delete the object: one naming
// another database (keys that collide anyway, say a store shared with a
// prefix rewritten by hand), and one naming this database whose rows are
// not the partition's (a physical copy of the cluster: same system
// identifier, same database name, sharing the prefix). Export refuses with
// an error and overwrites nothing; retention refuses a manifest that is not
// the export this database's journal recorded.
func TestExportAndRetentionRefuseAManifestThatIsNotThePartitions(t *testing.T) {
	ctx := context.Background()
	store := fakeS3(t, "shared")
	first := newDB(t, true)
	part := first.oldPartition(10, 200, true)
	rep := maintain(t, first.sweeper(exporting(store, 1*day, 2*day, 0)))
	if len(rep.Exported) != 1 {
		t.Fatalf("exported %+v", rep.Exported)
	}
	firstObj := rep.Exported[0].Object
	firstMan := getManifest(t, store, manifestOf(firstObj))
	if firstMan.Version != 2 || firstMan.SystemID == "" || firstMan.Database == "" || firstMan.ContentSHA256 == "" || !strings.HasPrefix(firstObj, firstMan.SystemID+"/"+firstMan.Database+"/") {
		t.Fatalf("manifest %+v of %s does not name the database", firstMan, firstObj)
	}

	for _, c := range []struct {
		name, want string
		manifest   func(d *db) sweep.Manifest
	}{
		{"another database's", "not this partition's", func(*db) sweep.Manifest { return firstMan }},
		{"this identity, other rows", "are not the partition's", func(d *db) sweep.Manifest {
			m := firstMan
			id := strings.SplitN(d.exportDir(), "/", 2)
			m.SystemID, m.Database = id[0], id[1]
			return m
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := newDB(t, true)
			if p := d.oldPartition(10, 200, true); p != part {
				t.Fatalf("partition %s, want %s", p, part)
			}
			obj := d.exportDir() + "/outbox_events/" + strings.TrimPrefix(part, "public.") + ".jsonl.gz"
			copyObject(t, store, firstObj, obj)
			putManifest(t, store, manifestOf(obj), c.manifest(d))
			rep, err := d.sweeper(exporting(store, 1*day, 2*day, 0)).Maintain(ctx, sweep.MaintainOptions{})
			if err == nil || !strings.Contains(err.Error(), c.want) || len(rep.Exported) != 0 {
				t.Fatalf("maintain: exported %+v, error %v; want a refusal saying %q", rep.Exported, err, c.want)
			}
			if !d.bool(`SELECT to_regclass($1) IS NOT NULL`, part) || d.journalState(part) != "archived" {
				t.Fatalf("after the refusal: partition dropped or journal %q", d.journalState(part))
			}
			if m := getManifest(t, store, manifestOf(obj)); !sameManifest(m, c.manifest(d)) {
				t.Fatalf("the manifest was overwritten: %+v", m)
			}
		})
	}

	// Retention: the first database's manifest replaced by one that names
	// another database, then by one of other bytes.
	for _, c := range []struct {
		name   string
		mutate func(m *sweep.Manifest)
	}{
		{"another database's", func(m *sweep.Manifest) { m.Database += "_other" }},
		{"other bytes", func(m *sweep.Manifest) { m.SHA256 = strings.Repeat("0", 64) }},
	} {
		m := firstMan
		c.mutate(&m)
		putManifest(t, store, manifestOf(firstObj), m)
		rep, err := first.sweeper(exporting(store, 1*day, 2*day, 3*day)).Maintain(ctx, sweep.MaintainOptions{})
		if err == nil || !strings.Contains(err.Error(), "not deleting") || len(rep.Deleted) != 0 {
			t.Fatalf("retention of %s manifest: deleted %v, error %v; want a refusal", c.name, rep.Deleted, err)
		}
		if _, err := store.Get(ctx, firstObj); err != nil || first.journalState(part) != "exported" {
			t.Fatalf("retention of %s manifest: object %v, journal %q", c.name, err, first.journalState(part))
		}
	}
	putManifest(t, store, manifestOf(firstObj), firstMan)
	rep = maintain(t, first.sweeper(exporting(store, 1*day, 2*day, 3*day)))
	if len(rep.Deleted) != 1 || rep.Deleted[0] != firstObj {
		t.Fatalf("retention of its own export: deleted %v", rep.Deleted)
	}
}

// Exports written before the keys named the database (<table>/<partition>,
// manifest version 1) keep working: retention finds them at the key the
// journal recorded and deletes them when the manifest is the export the
// journal recorded (sha256 and rows), not otherwise. An old-layout manifest
// is never taken for a partition's own at export: the partition is exported
// again under its own keys and the old object is left alone.
func TestExportsUnderTheOldKeysAreStillDeleted(t *testing.T) {
	ctx := context.Background()
	store := &countingStore{ColdStore: fakeS3(t, "")}
	d := newDB(t, true)
	part := d.oldPartition(10, 100, true)
	name := strings.TrimPrefix(part, "public.")
	rep := maintain(t, d.sweeper(exporting(store, 1*day, 2*day, 0)))
	if len(rep.Exported) != 1 {
		t.Fatalf("exported %+v", rep.Exported)
	}
	// Rewrite it as walbox wrote it before: the old keys, a version 1
	// manifest, the journal naming the old key.
	obj := rep.Exported[0].Object
	old := "outbox_events/" + name + ".jsonl.gz"
	copyObject(t, store, obj, old)
	m := getManifest(t, store, manifestOf(obj))
	m.Version, m.SystemID, m.Database, m.ContentSHA256, m.Object = 1, "", "", "", old
	putManifest(t, store, manifestOf(old), m)
	for _, k := range []string{obj, manifestOf(obj)} {
		if err := store.Delete(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	d.exec(`UPDATE walbox.archive_partitions SET object = $1 WHERE partition_name = $2`, old, part)

	// Another database's partition of that name, exported now: the old
	// manifest (same name, same rows) is not its own.
	other := newDB(t, true)
	other.oldPartition(10, 100, true)
	rep = maintain(t, other.sweeper(exporting(store, 1*day, 2*day, 0)))
	if len(rep.Exported) != 1 || rep.Exported[0].Resumed || rep.Exported[0].Object == old || store.puts[rep.Exported[0].Object] != 1 {
		t.Fatalf("the other database's export %+v: want its own upload, not the old-layout object", rep.Exported)
	}
	if got := getManifest(t, store, manifestOf(old)); !sameManifest(got, m) {
		t.Fatalf("the old-layout manifest changed: %+v", got)
	}

	// The old-layout manifest with other bytes than the journal recorded:
	// not deleted.
	bad := m
	bad.SHA256 = strings.Repeat("0", 64)
	putManifest(t, store, manifestOf(old), bad)
	if rep, err := d.sweeper(exporting(store, 1*day, 2*day, 3*day)).Maintain(ctx, sweep.MaintainOptions{}); err == nil || len(rep.Deleted) != 0 {
		t.Fatalf("retention of an old-layout export of other bytes: deleted %v, error %v", rep.Deleted, err)
	}
	putManifest(t, store, manifestOf(old), m)
	rep = maintain(t, d.sweeper(exporting(store, 1*day, 2*day, 3*day)))
	if len(rep.Deleted) != 1 || rep.Deleted[0] != old {
		t.Fatalf("retention of the old-layout export: deleted %v, want %s", rep.Deleted, old)
	}
	for _, k := range storeKeys(t, store) {
		if strings.HasPrefix(k, "outbox_events/") {
			t.Errorf("%s left in the store after its retention", k)
		}
	}
	if d.journalState(part) != "deleted" {
		t.Errorf("journal %q, want deleted", d.journalState(part))
	}
	if n := len(storeKeys(t, store)); n != 2 {
		t.Errorf("store holds %v, want the other database's export alone", storeKeys(t, store))
	}
}
