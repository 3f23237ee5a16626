package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// bareRelayArg, as the first argument, makes this binary the bare relay: the
// least a Go relay built on walbox's libraries does per event, in a process
// of its own so that its CPU is measured apart. It reads pgoutput from its
// own slot with pglogrepl, publishes each inserted row's payload with
// nats.go's PublishMsgAsync and one header (Nats-Msg-Id, the row's id),
// and confirms a transaction's end LSN once its acks are in: no order
// guard, no position headers, no routing, no dead letters, no marking, no
// metrics. Beside walbox's relay at the same live rate it tells what of the
// relay's CPU per event is walbox's and what any such relay pays here.
const bareRelayArg = "__bare_relay"

const (
	bareSlot    = "bench_bare"
	bareStream  = "BARE"
	bareSubject = "barerelay.events"
)

// bareResult is the bare relay at one live rate.
type bareResult struct {
	Rate         int
	Events       int
	CPU          time.Duration // the bare relay's, over the run
	WalsenderCPU time.Duration // its walsender's
	// Wake-ups of its threads and of its walsender, over the run.
	Wakeups, WalsenderWakeups uint64
	Where                     []cpuShare
}

// bareRelay runs the bare relay at the live rates the CPU targets name
// (1,000 and 2,000/s), with walbox's relay stopped: the same paced
// single-event transactions, each rate's events counted in stream BARE.
func (b *bench) bareRelay(ctx context.Context, produce produceFunc) error {
	var rates []int
	for _, r := range b.p.Rates {
		if r == 1000 || r == 2000 {
			rates = append(rates, r)
		}
	}
	if len(rates) == 0 {
		return nil
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	_, err = b.env.js.CreateStream(qctx, jetstream.StreamConfig{Name: bareStream, Subjects: []string{"barerelay.>"},
		Storage: jetstream.FileStorage, Duplicates: dupWindow})
	if err == nil {
		_, err = b.env.pool.Exec(qctx, "SELECT pg_create_logical_replication_slot($1, 'pgoutput')", bareSlot)
	}
	cancel()
	if err != nil {
		return fmt.Errorf("bare relay: create its stream and slot: %w", err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = b.env.js.DeleteStream(dctx, bareStream)
	}()
	b.logf("bare relay: pglogrepl + nats.go PublishMsgAsync with one header, acks awaited, in a process of its own")
	p, err := b.startProc("bare relay", self, []string{bareRelayArg, b.env.dbURL, bareSlot, b.env.ns.URL()},
		"GOMAXPROCS=1", "GODEBUG="+walboxGODEBUG) // as the relay runs
	if err != nil {
		return err
	}
	defer p.kill()
	wsPID, err := b.waitSlot(ctx, bareSlot, true, p)
	if err != nil {
		return err
	}
	t := liveTarget{system: "bare", stream: bareStream, subject: "bench.floor.bare", proc: p, producers: producers{produce: produce}}
	if err := b.warmUp(ctx, t); err != nil {
		return fmt.Errorf("bare relay: %w", err)
	}
	for _, r := range rates {
		b.logf("bare relay %d/s: single-event transactions for %v", r, b.p.LiveFor)
		base, err := b.streamMsgs(ctx, bareStream)
		if err != nil {
			return err
		}
		cpu0, err := p.cpu()
		if err != nil {
			return err
		}
		ws0, _ := procCPU(wsPID)
		wake0, _ := procWakeups(p.pid())
		wsWake0, _ := procWakeups(wsPID)
		meter := b.startPhase(p.pid())
		start := time.Now().Add(20 * time.Millisecond)
		prod, err := produce(ctx, fmt.Sprintf("%s.r%d", t.subject, r), r, start, start.Add(b.p.LiveFor))
		if err != nil {
			return fmt.Errorf("bare relay %d/s: %w", r, err)
		}
		if err := b.waitStream(ctx, t, base+uint64(prod.Events), fmt.Sprintf("the %d events at %d/s", prod.Events, r), 20*time.Millisecond); err != nil {
			return err
		}
		res := bareResult{Rate: r, Events: prod.Events}
		cpu1, err := p.cpu()
		if err != nil {
			return err
		}
		res.CPU = cpu1 - cpu0
		res.WalsenderCPU = b.walsenderSince(ctx, wsPID, ws0)
		res.Wakeups, res.WalsenderWakeups = wakeupsSince(p.pid(), wake0), wakeupsSince(wsPID, wsWake0)
		_, res.Where, _ = meter.stop()
		b.logf("bare relay %d/s: %d events; its CPU %.1f µs/event, its walsender's %.1f µs/event",
			r, res.Events, us(perEvent(res.CPU, res.Events)), us(perEvent(res.WalsenderCPU, res.Events)))
		b.res.bare = append(b.res.bare, res)
	}
	if err := p.stop(); err != nil {
		return fmt.Errorf("bare relay: %w", err)
	}
	if _, err := b.waitSlot(ctx, bareSlot, false, nil); err != nil {
		return err
	}
	qctx, cancel = context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if _, err := b.env.pool.Exec(qctx, "SELECT pg_drop_replication_slot($1)", bareSlot); err != nil {
		return fmt.Errorf("drop slot %s: %w", bareSlot, err)
	}
	return nil
}

// runBareRelay is the child: it relays until SIGTERM.
func runBareRelay(dbURL, slot, natsURL string) int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := bareRelayLoop(ctx, dbURL, slot, natsURL); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "bare relay:", err)
		return 1
	}
	return 0
}

// barePending is a published event; end is its transaction's end LSN when
// it is the transaction's last event (0 otherwise).
type barePending struct {
	fut jetstream.PubAckFuture
	end pglogrepl.LSN
}

func bareRelayLoop(ctx context.Context, dbURL, slot, natsURL string) error {
	cfg, err := pgconn.ParseConfig(dbURL)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["replication"] = "database"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return fmt.Errorf("connect for replication: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	nc, err := nats.Connect(natsURL)
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names '" + publication + "'"}})
	if err != nil {
		return fmt.Errorf("start replication: %w", err)
	}
	netConn := conn.Conn()
	stopRead := context.AfterFunc(ctx, func() { _ = netConn.SetReadDeadline(time.Now()) })
	defer stopRead()

	type columns struct{ id, payload int }
	rels := map[uint32]columns{}
	var pending []barePending
	var confirmed pglogrepl.LSN
	status := func() error {
		return pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{
			WALWritePosition: confirmed, WALFlushPosition: confirmed, WALApplyPosition: confirmed})
	}
	// settle takes the acked events at the head, in order.
	settle := func() error {
		for len(pending) > 0 {
			select {
			case <-pending[0].fut.Ok():
			case err := <-pending[0].fut.Err():
				return fmt.Errorf("publish: %w", err)
			default:
				return nil
			}
			if pending[0].end != 0 {
				confirmed = pending[0].end
			}
			pending[0] = barePending{}
			pending = pending[1:]
		}
		return nil
	}
	next := time.Now().Add(time.Second)
	if err := netConn.SetReadDeadline(next); err != nil {
		return err
	}
	for {
		if err := settle(); err != nil {
			return err
		}
		if time.Now().After(next) {
			if err := status(); err != nil {
				return fmt.Errorf("send status: %w", err)
			}
			next = time.Now().Add(time.Second)
			if err := netConn.SetReadDeadline(next); err != nil {
				return err
			}
		}
		msg, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if pgconn.Timeout(err) || errors.Is(err, os.ErrDeadlineExceeded) {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 {
			if e, ok := msg.(*pgproto3.ErrorResponse); ok {
				return fmt.Errorf("replication stream: %s", e.Message)
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			ka, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return err
			}
			if ka.ReplyRequested {
				if err := status(); err != nil {
					return fmt.Errorf("send status: %w", err)
				}
			}
		case pglogrepl.XLogDataByteID:
			xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return err
			}
			lm, err := pglogrepl.Parse(xld.WALData)
			if err != nil {
				return fmt.Errorf("decode pgoutput: %w", err)
			}
			switch m := lm.(type) {
			case *pglogrepl.RelationMessage:
				c := columns{id: -1, payload: -1}
				for i, col := range m.Columns {
					switch col.Name {
					case "id":
						c.id = i
					case "payload":
						c.payload = i
					}
				}
				if c.id < 0 || c.payload < 0 {
					return fmt.Errorf("relation %s.%s has no id or payload column", m.Namespace, m.RelationName)
				}
				rels[m.RelationID] = c
			case *pglogrepl.InsertMessage:
				c, ok := rels[m.RelationID]
				if !ok {
					return fmt.Errorf("insert into unknown relation %d", m.RelationID)
				}
				out := &nats.Msg{Subject: bareSubject, Header: nats.Header{jetstream.MsgIDHeader: {string(m.Tuple.Columns[c.id].Data)}},
					Data: m.Tuple.Columns[c.payload].Data}
				fut, err := js.PublishMsgAsync(out)
				if err != nil {
					return fmt.Errorf("publish: %w", err)
				}
				pending = append(pending, barePending{fut: fut})
			case *pglogrepl.CommitMessage:
				if len(pending) > 0 && pending[len(pending)-1].end == 0 {
					pending[len(pending)-1].end = pglogrepl.LSN(m.TransactionEndLSN)
				} else if len(pending) == 0 {
					confirmed = pglogrepl.LSN(m.TransactionEndLSN)
				}
			}
		}
	}
}
