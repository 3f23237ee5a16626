package app

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/sweep"
)

// tableSet is the outbox tables of a running relay: each table's routing
// (in the router) and its sweeper, by cdc.Event.Table. A table configured
// while walbox runs is added when the publication first sends it (see
// cdc.Config.OnUnknownTable): the config is read again, and the new table
// gets the next index.
type tableSet struct {
	cfg      config.Config
	log      zerolog.Logger
	reg      prometheus.Registerer
	template string // the sink's subject (topic) template
	reload   func() (config.Config, error)

	router *relay.Router
	// reader and the rest: what each sweeper reads back at start.
	reader     sweep.StreamReader
	source     string
	streams    []string
	window     int // the publish window's marks a crash can leave beyond a sweeper's queue
	sweeperCtx context.Context

	mu       sync.Mutex
	tables   []config.Table
	stops    []func()
	sweepers atomic.Pointer[[]*sweep.Sweeper]
}

// routerOptions are t's router options with the sink's template filled in.
func (ts *tableSet) routerOptions(t config.Table) relay.RouterOptions {
	return t.RouterOptions(ts.template)
}

// cdcTables lists the tables for the cdc source.
func (ts *tableSet) cdcTables() (tables []cdc.Table, defaultIdx int) {
	for i, t := range ts.tables {
		tables = append(tables, cdc.Table{Name: t.Name, Columns: t.Columns})
		if t.Default {
			defaultIdx = i
		}
	}
	return tables, defaultIdx
}

// addSweeper makes, wires and starts the sweeper of table t (the next index).
func (ts *tableSet) addSweeper(t config.Table) error {
	sw, err := NewTableSweeper(ts.cfg, t, ts.log, ts.reg)
	if err != nil {
		return err
	}
	if ts.reader != nil {
		sw.SetReader(ts.reader, ts.source, ts.streams, ts.window)
	}
	ts.stops = append(ts.stops, sw.Start(ts.sweeperCtx))
	next := append(slices.Clone(ts.current()), sw)
	ts.sweepers.Store(&next)
	return nil
}

func (ts *tableSet) current() []*sweep.Sweeper {
	if p := ts.sweepers.Load(); p != nil {
		return *p
	}
	return nil
}

// start builds the router shapes of every table and starts their sweepers.
func (ts *tableSet) start(ctx context.Context) error {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	ts.sweeperCtx = ctx
	for i, t := range ts.tables {
		if err := ts.router.SetTable(i, ts.routerOptions(t)); err != nil {
			return &config.Error{Key: t.Key, Msg: err.Error()}
		}
		if err := ts.addSweeper(t); err != nil {
			return err
		}
	}
	return nil
}

// stop writes every sweeper's queued marks and stops them.
func (ts *tableSet) stop() {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	for _, stop := range ts.stops {
		stop()
	}
	ts.stops = nil
}

// hook is relay.Config.OnDelivered: the mark goes to the sweeper of the
// event's table, then to next.
func (ts *tableSet) hook(next func(relay.Delivered)) func(relay.Delivered) {
	return func(d relay.Delivered) {
		if sws := ts.current(); d.Table >= 0 && d.Table < len(sws) {
			sws[d.Table].OnDelivered(d)
		}
		if next != nil {
			next(d)
		}
	}
}

// unknown is cdc.Config.OnUnknownTable: it reads the config again and,
// when the table is configured now, sets up its routing and sweeper.
func (ts *tableSet) unknown(name cdc.TableName) (int, cdc.Columns, bool) {
	if ts.reload == nil {
		return -1, cdc.Columns{}, false
	}
	cfg, err := ts.reload()
	if err == nil {
		err = cfg.Validate()
	}
	if err != nil {
		ts.log.Error().Err(err).Str("table", name.String()).Msg("the publication sends a table walbox does not know, and the config file, read again for it, is not valid")
		return -1, cdc.Columns{}, false
	}
	all, err := cfg.Tables()
	if err != nil {
		return -1, cdc.Columns{}, false
	}
	i := slices.IndexFunc(all, func(t config.Table) bool { return t.Name == name })
	if i < 0 {
		return -1, cdc.Columns{}, false
	}
	t := all[i]
	ts.mu.Lock()
	defer ts.mu.Unlock()
	if j := slices.IndexFunc(ts.tables, func(k config.Table) bool { return k.Name == name }); j >= 0 {
		return j, ts.tables[j].Columns, true
	}
	idx := len(ts.tables)
	if err := ts.router.SetTable(idx, ts.routerOptions(t)); err != nil {
		ts.log.Error().Err(err).Str("table", name.String()).Msg("cannot route the newly configured table")
		return -1, cdc.Columns{}, false
	}
	if err := ts.addSweeper(t); err != nil {
		ts.log.Error().Err(err).Str("table", name.String()).Msg("cannot start the sweeper of the newly configured table")
		return -1, cdc.Columns{}, false
	}
	ts.tables = append(ts.tables, t)
	ts.log.Info().Str("table", name.String()).Str("key", t.Key).Msg("outbox table added to the configuration while running: publishing it")
	return idx, t.Columns, true
}
