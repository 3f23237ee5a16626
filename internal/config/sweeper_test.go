package config

import (
	"testing"
	"time"
)

func TestSweeperAndArchiveDefaults(t *testing.T) {
	cfg, err := load(t, validYAML)
	if err != nil {
		t.Fatal(err)
	}
	want := Sweeper{MarkProcessed: true, BatchSize: 1000, Interval: 200 * time.Millisecond, PartitionStep: "day", PartitionsAhead: 7, Maintain: true, YieldAfter: time.Second, LockTimeout: 100 * time.Millisecond}
	if cfg.Sweeper != want {
		t.Errorf("sweeper %+v, want %+v", cfg.Sweeper, want)
	}
	if cfg.Archive.After != 2160*time.Hour || cfg.Archive.ExportAfter != 0 || cfg.Archive.DeleteAfter != 26280*time.Hour || !cfg.Archive.S3.UseSSL {
		t.Errorf("archive %+v", cfg.Archive)
	}
}

func TestSweeperAndArchiveFromFileAndEnv(t *testing.T) {
	cfg, err := load(t, validYAML+`
sweeper: {mark_processed: false, batch_size: 500, interval: 1s, partition_step: month, partitions_ahead: 40, maintain: false, yield_after: 0s}
archive:
  after: 720h
  export_after: 1440h
  delete_after: 0s
  s3: {endpoint: "minio:9000", bucket: outbox, prefix: prod, use_ssl: false}
`, "WALBOX_ARCHIVE_S3_ACCESS_KEY=ak", "WALBOX_ARCHIVE_S3_SECRET_KEY=sk", "WALBOX_SWEEPER_BATCH_SIZE=2000")
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Sweeper != (Sweeper{MarkProcessed: false, BatchSize: 2000, Interval: time.Second, PartitionStep: "month", PartitionsAhead: 40, Maintain: false, YieldAfter: 0, LockTimeout: 100 * time.Millisecond}) {
		t.Errorf("sweeper %+v", cfg.Sweeper)
	}
	want := Archive{After: 720 * time.Hour, ExportAfter: 1440 * time.Hour, S3: S3{Endpoint: "minio:9000", Bucket: "outbox", Prefix: "prod", AccessKey: "ak", SecretKey: "sk"}}
	if cfg.Archive != want {
		t.Errorf("archive %+v, want %+v", cfg.Archive, want)
	}
}

func TestSweeperAndArchiveErrorsNameTheKey(t *testing.T) {
	for _, tc := range []struct {
		yaml, key string
	}{
		{"sweeper: {batch_size: 0}", "sweeper.batch_size"},
		{"sweeper: {interval: 0s}", "sweeper.interval"},
		{"sweeper: {partition_step: week}", "sweeper.partition_step"},
		{"sweeper: {partitions_ahead: 0}", "sweeper.partitions_ahead"},
		{"sweeper: {yield_after: -1s}", "sweeper.yield_after"},
		{"archive: {after: -1h}", "archive.after"},
		{"archive: {export_after: 100h, dir: /x}", "archive.export_after"}, // shorter than after
		{"archive: {after: 0s, export_after: 100h, dir: /x}", "archive.export_after"},
		{"archive: {export_after: 2400h}", "archive.export_after"}, // nowhere to export
		{"archive: {export_after: 2400h, dir: /x, s3: {endpoint: e, bucket: b}}", "archive.dir"},
		{"archive: {export_after: 2400h, dir: /x, delete_after: 2000h}", "archive.delete_after"},
		{"archive: {s3: {bucket: b}}", "archive.s3.endpoint"},
		{"archive: {s3: {endpoint: 'https://s3.example.com', bucket: b}}", "archive.s3.endpoint"},
		{"archive: {s3: {endpoint: e, bucket: b, access_key: a}}", "archive.s3.access_key"},
		{"archive: {s3: {bucket_name: b}}", "archive.s3.bucket_name"},
	} {
		_, err := load(t, validYAML+tc.yaml+"\n")
		wantErrNaming(t, err, tc.key)
	}
}

func TestExportWithDefaultsIsValid(t *testing.T) {
	// export_after alone (with a place to export) works with the default
	// after and delete_after.
	if _, err := load(t, validYAML+"archive: {export_after: 4320h, dir: /var/lib/walbox/archive}\n"); err != nil {
		t.Fatal(err)
	}
}
