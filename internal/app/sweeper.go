package app

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay/sweep"
)

// NewSweeper builds the sweeper (processed marks, partitions, archival) from
// the config. Run starts it beside the relay; `walbox archive` and `walbox
// status` use it on its own. reg may be nil (metrics unregistered). It does
// not connect.
func NewSweeper(cfg config.Config, log zerolog.Logger, reg prometheus.Registerer) (*sweep.Sweeper, error) {
	t, err := cfg.DefaultTable()
	if err != nil {
		return nil, err
	}
	return NewTableSweeper(cfg, t, log, reg)
}

// NewTableSweeper is NewSweeper for one outbox table, with that table's
// sweeper settings. Its metrics carry the table label when reg is set.
func NewTableSweeper(cfg config.Config, t config.Table, log zerolog.Logger, reg prometheus.Registerer) (*sweep.Sweeper, error) {
	if reg != nil {
		reg = prometheus.WrapRegistererWith(prometheus.Labels{"table": t.Name.String()}, reg)
	}
	table, cols := t.Name, t.Columns
	// The first table owns the stored messages that name no table: a relay
	// from before walbox recorded it wrote them (the relay's resume check
	// reads them the same way).
	first := false
	if all, err := cfg.Tables(); err == nil && len(all) > 0 {
		first = all[0].Name == t.Name
	}
	var err error
	a := cfg.Archive
	var store sweep.ColdStore
	if a.ExportAfter > 0 {
		switch {
		case a.Dir != "":
			if store, err = sweep.NewDirStore(a.Dir); err != nil {
				return nil, &config.Error{Key: "archive.dir", Msg: err.Error()}
			}
		case a.S3.Bucket != "":
			store, err = sweep.NewS3Store(sweep.S3Config{Endpoint: a.S3.Endpoint, Bucket: a.S3.Bucket, Prefix: a.S3.Prefix,
				AccessKey: a.S3.AccessKey, SecretKey: a.S3.SecretKey, UseSSL: a.S3.UseSSL})
			if err != nil {
				return nil, &config.Error{Key: "archive.s3", Msg: err.Error()}
			}
		}
	}
	sw, err := sweep.New(sweep.Config{
		ConnString:      cfg.Postgres.URL,
		Table:           table,
		Unlabelled:      first,
		Columns:         cols,
		MarkProcessed:   t.Sweeper.MarkProcessed,
		BatchSize:       t.Sweeper.BatchSize,
		Interval:        t.Sweeper.Interval,
		YieldAfter:      cfg.Sweeper.YieldAfter,
		LockTimeout:     cfg.Sweeper.LockTimeout,
		PartitionStep:   t.Sweeper.PartitionStep,
		PartitionsAhead: t.Sweeper.PartitionsAhead,
		NoMaintenance:   !t.Sweeper.Maintain,
		Archive:         sweep.ArchiveConfig{After: a.After, ExportAfter: a.ExportAfter, DeleteAfter: a.DeleteAfter, Store: store},
		BackoffInitial:  cfg.Retry.Initial,
		BackoffMax:      cfg.Retry.Max,
		Logger:          log.With().Str("table", t.Name.String()).Logger(),
		Registry:        reg,
	})
	if err != nil {
		return nil, &config.Error{Key: "sweeper", Msg: err.Error()}
	}
	return sw, nil
}
