package cdc

import (
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
)

// fakeStream is a stream on a connection to a fakeWalsender, its status
// update due StatusInterval from now, handing batches to a buffered channel.
// Call it inside a synctest bubble.
func fakeStream(t *testing.T, mod func(*Config)) (*stream, *fakeWalsender, chan []Change) {
	t.Helper()
	src := testSource(t, mod)
	conn, ws := dialFake(t, nil)
	out := make(chan []Change, 64)
	st := &stream{src: src, conn: conn, out: out, dec: newDecoder(src.cfg.Table, src.cfg.Columns),
		nextStatus: time.Now().Add(src.cfg.StatusInterval)}
	return st, ws, out
}

// wantStatus checks one standby status update: walbox reports the relay's
// confirmed position as written, flushed and applied alike, stamped with
// the client's clock, and never asks for a reply.
func wantStatus(t *testing.T, su statusUpdate, lsn LSN, at time.Time) {
	t.Helper()
	if su.write != lsn || su.flush != lsn || su.apply != lsn || su.reply || !su.clientTime.Equal(at) {
		t.Errorf("status update %+v, want write = flush = apply = %s at %v, no reply requested", su, lsn, at)
	}
}

// statusAt is a status update's LSN (write, flush and apply) and time.
type statusAt struct {
	lsn LSN
	at  time.Time
}

// wantStatuses checks the status updates ws has read since the last call:
// one per want, in order. In a synctest bubble call it after synctest.Wait.
func wantStatuses(t *testing.T, ws *fakeWalsender, when string, want ...statusAt) {
	t.Helper()
	sus := ws.statuses()
	if len(sus) != len(want) {
		t.Fatalf("%s: status updates %+v, want %d", when, sus, len(want))
	}
	for i, w := range want {
		wantStatus(t, sus[i], w.lsn, w.at)
	}
}

// TestKeepalives: a primary keepalive, inside and outside an open
// transaction, with and without reply-requested: what is handed to the
// relay, what status the source sends back, and what it reports received.
func TestKeepalives(t *testing.T) {
	for _, c := range []struct {
		name         string
		inTxn        bool
		before       LSN // WAL end of an earlier keepalive, 0 for none
		walEnd       LSN
		reply        bool
		wantHanded   []Change
		wantStatus   bool
		wantReceived LSN
	}{
		{name: "outside a transaction, reply requested", walEnd: 0x3000000, reply: true,
			wantHanded: []Change{{Kind: KindWALEnd, LSN: 0x3000000}}, wantStatus: true, wantReceived: 0x3000000},
		{name: "outside a transaction", walEnd: 0x3000000,
			wantHanded: []Change{{Kind: KindWALEnd, LSN: 0x3000000}}, wantReceived: 0x3000000},
		{name: "inside a transaction, reply requested", inTxn: true, walEnd: 0x3000000, reply: true,
			wantStatus: true, wantReceived: 0x3000000},
		{name: "inside a transaction", inTxn: true, walEnd: 0x3000000, wantReceived: 0x3000000},
		{name: "a WAL end of zero, reply requested", walEnd: 0, reply: true, wantStatus: true},
		{name: "an older WAL end is handed over but not received", before: 0x3000000, walEnd: 0x2000000,
			wantHanded: []Change{{Kind: KindWALEnd, LSN: 0x2000000}}, wantReceived: 0x3000000},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				st, ws, out := fakeStream(t, nil)
				st.src.Confirm(0x1000000)
				if c.before != 0 {
					if err := st.handleCopyData(t.Context(), keepaliveMsg(c.before, serverClock, false)); err != nil {
						t.Fatal(err)
					}
					handedOver(out)
				}
				if c.inTxn {
					feed(t, st, 0x100, beginMsg(0x3000100, commitTime, 1))
				}
				if err := st.handleCopyData(t.Context(), keepaliveMsg(c.walEnd, serverClock, c.reply)); err != nil {
					t.Fatal(err)
				}
				synctest.Wait()

				var got []Change
				for _, b := range handedOver(out) {
					got = append(got, b...)
				}
				if !reflect.DeepEqual(got, c.wantHanded) {
					t.Errorf("handed over %+v, want %+v", got, c.wantHanded)
				}
				sus := ws.statuses()
				switch {
				case c.wantStatus && len(sus) == 1:
					wantStatus(t, sus[0], 0x1000000, time.Now())
				case c.wantStatus || len(sus) != 0:
					t.Errorf("status updates %+v, want one: %v", sus, c.wantStatus)
				}
				if r := st.src.Received(); r != c.wantReceived {
					t.Errorf("received %s, want %s", r, c.wantReceived)
				}
				if c.inTxn && (len(st.batch) != 1 || st.batch[0].Kind != KindBegin) {
					t.Errorf("the open transaction's batch is %+v", st.batch)
				}
			})
		})
	}
}

// TestStatusAfterReconnect: after a new session started, confirmations of
// the old one still in flight are dropped until the relay takes the reset;
// the status sent meanwhile is 0 (which the server ignores), not an LSN of
// the old slot.
func TestStatusAfterReconnect(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st, ws, _ := fakeStream(t, nil)
		src := st.src
		src.Confirm(0x500)
		src.Confirm(0x400) // never backwards
		if src.Confirmed() != 0x500 {
			t.Fatalf("confirmed %s", src.Confirmed())
		}
		// What session() does when it starts again.
		src.confirmed.fence()
		src.Confirm(0x600)
		if err := st.handleCopyData(t.Context(), keepaliveMsg(0x700, serverClock, true)); err != nil {
			t.Fatal(err)
		}
		src.ResetTaken()
		src.Confirm(0x650)
		if err := st.handleCopyData(t.Context(), keepaliveMsg(0x700, serverClock, true)); err != nil {
			t.Fatal(err)
		}
		synctest.Wait()
		wantStatuses(t, ws, "after two keepalives", statusAt{0, time.Now()}, statusAt{0x650, time.Now()})
	})
}

// TestStatusWhileTheRelayTakesNothing: while a batch waits for the relay
// (NATS down, window full) status updates still go out every
// StatusInterval, with whatever the relay confirmed meanwhile, or the
// walsender would drop the connection after wal_sender_timeout.
func TestStatusWhileTheRelayTakesNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := testSource(t, func(c *Config) { c.StatusInterval = 10 * time.Second })
		conn, ws := dialFake(t, nil)
		out := make(chan []Change) // the relay takes nothing until the test says so
		start := time.Now()
		st := &stream{src: src, conn: conn, out: out, dec: newDecoder(outboxTable, DefaultColumns()), nextStatus: start.Add(10 * time.Second)}
		src.Confirm(0x100)
		feed(t, st, 0x100, beginMsg(0x200, commitTime, 1))
		done := make(chan error, 1)
		go func() {
			done <- st.handleCopyData(t.Context(), xlogData(0x100, 0x300, serverClock, commitMsg(0x200, 0x230, commitTime)))
		}()
		time.Sleep(15 * time.Second) // fake time: the bubble's clock
		src.Confirm(0x180)
		time.Sleep(10 * time.Second)
		synctest.Wait() // every goroutine is blocked: what has not happened will not
		select {
		case err := <-done:
			t.Fatalf("the hand-over returned (%v) before the relay took it", err)
		default:
		}
		b := <-out
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(kinds(b), []ChangeKind{KindBegin, KindCommit}) {
			t.Errorf("batch %+v", b)
		}
		synctest.Wait()
		wantStatuses(t, ws, "in 25 s", statusAt{0x100, start.Add(10 * time.Second)}, statusAt{0x180, start.Add(20 * time.Second)})
		if want := start.Add(30 * time.Second); !st.nextStatus.Equal(want) {
			t.Errorf("next status due %v, want %v", st.nextStatus, want)
		}
	})
}

// TestRun drives a whole session's read loop against the fake walsender:
// the frames it sends, the batches handed over, the status updates, and
// how the loop ends.
func TestRun(t *testing.T) {
	copyData := func(b []byte) pgproto3.BackendMessage { return &pgproto3.CopyData{Data: b} }
	for _, c := range []struct {
		name    string
		last    pgproto3.BackendMessage // nil: the context is cancelled
		wantErr func(error) bool
		wantMsg string
	}{
		{"the slot is invalidated", &pgproto3.ErrorResponse{Severity: "ERROR", Code: "55000", Message: `can no longer get changes from replication slot "walbox"`},
			func(err error) bool { return errors.Is(err, ErrSlotLost) }, `replication slot lost: ERROR: can no longer get changes from replication slot "walbox" (SQLSTATE 55000)`},
		{"the slot is dropped", &pgproto3.ErrorResponse{Severity: "ERROR", Code: "42704", Message: `replication slot "walbox" does not exist`},
			func(err error) bool { return errors.Is(err, ErrSlotLost) }, `replication slot lost: ERROR: replication slot "walbox" does not exist (SQLSTATE 42704)`},
		{"another server error", &pgproto3.ErrorResponse{Severity: "ERROR", Code: "XX000", Message: "could not read WAL"},
			func(err error) bool { return err != nil && !errors.Is(err, ErrSlotLost) && !IsPermanent(err) }, "replication stream: ERROR: could not read WAL (SQLSTATE XX000)"},
		{"the server ends the copy", &pgproto3.CopyDone{},
			func(err error) bool { return err != nil && !IsPermanent(err) }, "replication stream: server ended the copy stream"},
		{"a frame that does not parse", copyData([]byte{'w', 0, 1}),
			func(err error) bool { return err != nil && !IsPermanent(err) }, "parse XLogData: XLogData must be at least 24 bytes, got 2"},
		{"shut down", nil,
			func(err error) bool { return errors.Is(err, context.Canceled) }, "context canceled"},
	} {
		t.Run(c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				src := testSource(t, func(cfg *Config) { cfg.StatusInterval = 10 * time.Second })
				conn, ws := dialFake(t, nil)
				out := make(chan []Change, 64)
				st := &stream{src: src, conn: conn, out: out, dec: newDecoder(outboxTable, DefaultColumns())}
				ctx, cancel := context.WithCancel(t.Context())
				defer cancel()
				start := time.Now()
				done := make(chan error, 1)
				go func() { done <- st.run(ctx) }()

				// A transaction, a notice, and a keepalive asking for a reply.
				if err := ws.send(
					copyData(xlogData(0x200, 0x240, serverClock, beginMsg(0x200, commitTime, 1))),
					copyData(xlogData(0x200, 0x240, serverClock, relationMsg(outboxRel, "public", "outbox_events", outboxColumns...))),
					copyData(xlogData(0x200, 0x240, serverClock, insertMsg(outboxRel, outboxRow("a", "t", `{}`)...))),
					&pgproto3.NoticeResponse{Severity: "NOTICE", Message: "nothing to see"},
					copyData(xlogData(0x200, 0x240, serverClock, commitMsg(0x200, 0x230, commitTime))),
				); err != nil {
					t.Fatal(err)
				}
				synctest.Wait()
				bs := handedOver(out)
				if len(bs) != 1 || !reflect.DeepEqual(kinds(bs[0]), []ChangeKind{KindBegin, KindEvent, KindCommit}) || bs[0][1].Event.ID != "a" {
					t.Fatalf("batches %+v", bs)
				}
				if !st.streamed || src.Received() != 0x240 {
					t.Errorf("streamed %v, received %s", st.streamed, src.Received())
				}
				src.Confirm(0x230)
				if err := ws.send(copyData(keepaliveMsg(0x300, serverClock, true))); err != nil {
					t.Fatal(err)
				}
				synctest.Wait()
				wantStatuses(t, ws, "the reply", statusAt{0x230, start})
				if bs := handedOver(out); len(bs) != 1 || !reflect.DeepEqual(bs[0], []Change{{Kind: KindWALEnd, LSN: 0x300}}) {
					t.Fatalf("batches %+v", bs)
				}

				// Idle: a status update every StatusInterval all the same.
				time.Sleep(25 * time.Second) // fake time: the bubble's clock
				synctest.Wait()
				wantStatuses(t, ws, "idle for 25 s", statusAt{0x230, start.Add(10 * time.Second)}, statusAt{0x230, start.Add(20 * time.Second)})

				// The end, and the final status on the way out.
				src.Confirm(0x300)
				if c.last == nil {
					cancel()
				} else if err := ws.send(c.last); err != nil {
					t.Fatal(err)
				}
				err := <-done
				if !c.wantErr(err) || err.Error() != c.wantMsg {
					t.Fatalf("run returned %v, want %q", err, c.wantMsg)
				}
				synctest.Wait()
				wantStatuses(t, ws, "the final one on the way out", statusAt{0x300, time.Now()})
			})
		})
	}
}

// TestRunReadError: a connection that breaks is an error to reconnect
// after, and no final status is attempted on a closed connection.
func TestRunReadError(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		src := testSource(t, nil)
		conn, _ := dialFake(t, nil)
		st := &stream{src: src, conn: conn, out: make(chan []Change, 1), dec: newDecoder(outboxTable, DefaultColumns())}
		done := make(chan error, 1)
		go func() { done <- st.run(t.Context()) }()
		synctest.Wait()
		_ = conn.Conn().Close() // as a network failure would
		err := <-done
		if err == nil || IsPermanent(err) || !strings.HasPrefix(err.Error(), "receive replication message: ") {
			t.Fatalf("run returned %v", err)
		}
		if !conn.IsClosed() {
			t.Errorf("pgconn did not mark the broken connection closed")
		}
	})
}

// TestStatusSendFails: a status update that cannot be written ends the
// session with that error.
func TestStatusSendFails(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		st, _, _ := fakeStream(t, nil)
		_ = st.conn.Conn().Close()
		err := st.handleCopyData(t.Context(), keepaliveMsg(0, serverClock, true))
		if err == nil || !strings.HasPrefix(err.Error(), "send standby status: ") {
			t.Fatalf("err %v", err)
		}
	})
}

// TestRunReconnects: Run retries what reconnecting may cure, with a
// doubling back-off and OnReconnect before each attempt, returns nil once
// cancelled, and returns at once what retrying cannot fix.
func TestRunReconnects(t *testing.T) {
	t.Run("transient failures", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			var attempts []time.Time
			src := testSource(t, func(c *Config) {
				// A Unix socket that is not there: every connect fails at once.
				c.ConnString = "host=" + t.TempDir() + " user=walbox database=app sslmode=disable"
				c.BackoffInitial, c.BackoffMax = time.Second, 4*time.Second
				c.HeartbeatInterval = time.Second // idle: never connects while the stream is down
				c.OnReconnect = func() { attempts = append(attempts, time.Now()) }
			})
			ctx, cancel := context.WithCancel(t.Context())
			done := make(chan error, 1)
			start := time.Now()
			go func() { done <- src.Run(ctx, make(chan []Change)) }()
			time.Sleep(20 * time.Second) // fake time: 20 s of reconnect attempts
			cancel()
			if err := <-done; err != nil {
				t.Fatalf("Run returned %v after cancellation, want nil", err)
			}
			// Back-off of 1 s doubling to at most 4 s, each ±20 %.
			want := []time.Duration{0, time.Second, 2 * time.Second, 4 * time.Second, 4 * time.Second}
			if len(attempts) < len(want) {
				t.Fatalf("%d reconnects in 20 s: %v", len(attempts), attempts)
			}
			prev := start
			for i, w := range want {
				gap := attempts[i].Sub(prev)
				if gap < w*8/10 || gap > w*12/10 {
					t.Errorf("reconnect %d after %v, want %v ±20%%", i, gap, w)
				}
				prev = attempts[i]
			}
			if src.Connected() {
				t.Error("connected without a server")
			}
		})
	})
	t.Run("a URL that does not parse", func(t *testing.T) {
		src := testSource(t, func(c *Config) {
			c.ConnString = "postgres://walbox:secret@db.internal:notaport/app"
			c.OnReconnect = func() { t.Error("reconnecting after a configuration error") }
		})
		err := src.Run(t.Context(), make(chan []Change))
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Key != "postgres.url" {
			t.Fatalf("Run returned %v, want the postgres.url ConfigError", err)
		}
	})
}
