package cdc

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
)

// Origin says which WAL history a session's positions belong to: the
// cluster's system identifier (IDENTIFY_SYSTEM) and timeline. Two positions
// mean something to each other only inside one history: the same system and
// timeline, or an earlier timeline of that system below the point where it
// was left (TIMELINE_HISTORY). A restore, a promoted standby that lagged, or
// another cluster with the same names has positions that do not continue
// what a stream already holds.
type Origin struct {
	SystemID string
	Timeline int32
	// Left maps each ancestor timeline to the WAL position where the
	// history moved on from it.
	Left map[int32]LSN
	// WALPos is how far the server's WAL reached when the session started
	// (IDENTIFY_SYSTEM's xlogpos): a position of this system and timeline
	// at or past it was written by a history the server no longer has (it
	// was restored from a snapshot).
	WALPos LSN
}

// Comparable reports whether a position at pos, recorded on system sys and
// timeline tl, is part of this origin's history, so that comparing it with
// this origin's positions says which came first.
func (o *Origin) Comparable(sys string, tl int32, pos LSN) bool {
	if o == nil || sys == "" || sys != o.SystemID || tl <= 0 {
		return false
	}
	if tl == o.Timeline {
		return true
	}
	end, ok := o.Left[tl]
	return ok && pos < end
}

func (o *Origin) String() string {
	if o == nil {
		return "unknown"
	}
	return fmt.Sprintf("system %s timeline %d", o.SystemID, o.Timeline)
}

// identify reads the server's origin on a replication connection.
func identify(ctx context.Context, conn *pgconn.PgConn) (*Origin, error) {
	sys, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return nil, fmt.Errorf("identify system: %w", err)
	}
	o := &Origin{SystemID: sys.SystemID, Timeline: sys.Timeline, Left: map[int32]LSN{}, WALPos: sys.XLogPos}
	if sys.Timeline > 1 {
		h, err := pglogrepl.TimelineHistory(ctx, conn, sys.Timeline)
		if err != nil {
			return nil, fmt.Errorf("read timeline history of timeline %d: %w", sys.Timeline, err)
		}
		if o.Left, err = parseTimelineHistory(h.Content); err != nil {
			return nil, fmt.Errorf("timeline history %s: %w", h.FileName, err)
		}
	}
	return o, nil
}

// parseTimelineHistory reads a timeline history file: one line per ancestor,
// "parent-timeline <tab> switch-point <tab> reason"; # starts a comment.
func parseTimelineHistory(content []byte) (map[int32]LSN, error) {
	left := map[int32]LSN{}
	sc := bufio.NewScanner(bytes.NewReader(content))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 2 {
			return nil, fmt.Errorf("malformed line %q", line)
		}
		tl, err := strconv.ParseInt(f[0], 10, 32)
		if err != nil {
			return nil, fmt.Errorf("malformed timeline in %q", line)
		}
		lsn, err := pglogrepl.ParseLSN(f[1])
		if err != nil {
			return nil, fmt.Errorf("malformed switch point in %q", line)
		}
		left[int32(tl)] = lsn
	}
	return left, sc.Err()
}

// IdentifyServer opens a replication connection to connString and reads the
// server's origin: its system identifier, timeline (with the history of its
// ancestors) and how far its WAL has reached. For tools (walbox status).
func IdentifyServer(ctx context.Context, connString string) (*Origin, error) {
	conn, err := connectReplication(ctx, connString)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return identify(ctx, conn)
}
