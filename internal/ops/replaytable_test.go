package ops

import (
	"strings"
	"testing"
	"time"

	"github.com/walbox/walbox/internal/config"
)

// replay reads the table --table names (the default one without it), with
// that table's columns, or its archive.
func TestReplayTableFollowsTheConfig(t *testing.T) {
	cfg := config.Default()
	cfg.Outboxes = []config.OutboxEntry{{Outbox: config.Outbox{Table: "public.outbox_events"}},
		{Outbox: config.Outbox{Table: "billing.outbox", Columns: map[string]string{"id": "event_id"}}, Default: true}}
	from := ReplayOptions{From: time.Unix(0, 0), To: time.Now()}
	for _, c := range []struct {
		table   string
		archive bool
		want    string
		idCol   string
	}{
		{"", false, "billing.outbox", "event_id"},
		{"outbox_events", false, "public.outbox_events", "id"},
		{"billing.outbox", true, "walbox.billing_outbox_archive", "event_id"},
	} {
		o := from
		o.Table, o.Archive = c.table, c.archive
		tb, name, err := replayTable(cfg, o)
		if err != nil || name.String() != c.want || tb.Columns[0] != c.idCol {
			t.Errorf("--table %q archive %v: %s (id column %q), %v", c.table, c.archive, name, tb.Columns[0], err)
		}
	}
	o := from
	o.Table = "shipping.outbox"
	if _, _, err := replayTable(cfg, o); err == nil || !strings.Contains(err.Error(), "shipping.outbox is not a configured outbox table") {
		t.Errorf("unknown table: %v", err)
	}
	if _, _, err := replayTable(cfg, ReplayOptions{}); err == nil || !strings.Contains(err.Error(), "select the events") {
		t.Errorf("no selection: %v", err)
	}
}
