package config

import (
	"strings"
	"time"
)

// validateSweeper checks the sweeper and archive sections.
func (c *Config) validateSweeper(bad func(key, format string, args ...any)) {
	sw := c.Sweeper
	if sw.BatchSize < 1 || sw.BatchSize > 100000 {
		bad("sweeper.batch_size", "%d: must be between 1 and 100000", sw.BatchSize)
	}
	if sw.Interval <= 0 || sw.Interval > time.Minute {
		bad("sweeper.interval", "%s: must be between 1ms and 1m", sw.Interval)
	}
	switch sw.PartitionStep {
	case "day", "month":
	default:
		bad("sweeper.partition_step", "%q: use day or month", sw.PartitionStep)
	}
	if sw.YieldAfter < 0 {
		bad("sweeper.yield_after", "%s: must not be negative (0: the sweeper never yields to a catching-up relay)", sw.YieldAfter)
	}
	if sw.LockTimeout < time.Millisecond || sw.LockTimeout > 10*time.Second {
		bad("sweeper.lock_timeout", "%s: must be between 1ms and 10s (every INSERT of a partition walbox locks may wait this long behind a request that has to wait)", sw.LockTimeout)
	}
	if sw.PartitionsAhead < 1 || sw.PartitionsAhead > 366 {
		bad("sweeper.partitions_ahead", "%d: must be between 1 and 366 (days)", sw.PartitionsAhead)
	}

	a := c.Archive
	if a.After < 0 {
		bad("archive.after", "must not be negative (0 turns archival off)")
	}
	if a.DeleteAfter < 0 {
		bad("archive.delete_after", "must not be negative (0 keeps exports forever)")
	}
	if a.ExportAfter < 0 {
		bad("archive.export_after", "must not be negative (0 turns export off)")
	}
	if a.ExportAfter > 0 {
		switch {
		case a.After == 0:
			bad("archive.export_after", "needs archive.after > 0: only archived partitions are exported")
		case a.ExportAfter < a.After:
			bad("archive.export_after", "%s is shorter than archive.after (%s): a partition is exported after it was archived", a.ExportAfter, a.After)
		}
		switch {
		case a.Dir == "" && a.S3.Bucket == "":
			bad("archive.export_after", "is set but there is nowhere to export: set archive.dir or archive.s3.bucket")
		case a.Dir != "" && a.S3.Bucket != "":
			bad("archive.dir", "set archive.dir or archive.s3.bucket, not both")
		}
		if a.DeleteAfter > 0 && a.DeleteAfter <= a.ExportAfter {
			bad("archive.delete_after", "%s must be longer than archive.export_after (%s), or 0 to keep exports forever", a.DeleteAfter, a.ExportAfter)
		}
	}
	s3 := a.S3
	if s3.Bucket != "" && s3.Endpoint == "" {
		bad("archive.s3.endpoint", "is required with archive.s3.bucket: host[:port], e.g. s3.eu-west-1.amazonaws.com")
	}
	if strings.Contains(s3.Endpoint, "://") || strings.Contains(s3.Endpoint, "/") {
		bad("archive.s3.endpoint", "%q: give host[:port] only, without scheme or path (archive.s3.use_ssl chooses https)", s3.Endpoint)
	}
	if (s3.AccessKey == "") != (s3.SecretKey == "") {
		bad("archive.s3.access_key", "set both archive.s3.access_key and archive.s3.secret_key, or neither (then AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the instance role are used)")
	}
}
