// Command wm is the Watermill peer of the walbox benchmark: the transactional
// outbox as Watermill documents it (the "forwarder" component), PostgreSQL ->
// NATS JetStream. It is its own Go module so that Watermill never enters the
// product's go.mod.
//
//	wm load    -pg URL -subject S -n N [-txn 10] [-conns 4]
//	wm forward -pg URL -nats URL [-poll 100ms]
//	wm produce -pg URL -subject S -rate R -for D [-sync-commit on|off]
//
// Common flags: -forwarder-topic (walbox_bench_forwarder), -payload-bytes (200).
//
// Producers (load, produce) open a transaction, publish through
// forwarder.NewPublisher(sql.NewPublisher(tx)) with the NATS subject as the
// destination topic, and commit: the forwarder envelope (JSON: destination
// topic, UUID, base64 payload, metadata) is one row of the table
// "watermill_<forwarder-topic>" written in the producer's own transaction.
// `load` publishes the -txn messages of a transaction in one Publish call
// (one multi-row INSERT), as the walbox catch-up load does.
//
// `forward` runs forwarder.NewForwarder(watermill-sql subscriber, watermill-nats
// publisher). Settings chosen here (everything else at the library defaults):
//   - SQL subscriber (watermill-sql v4): DefaultPostgreSQLSchema,
//     DefaultPostgreSQLOffsetsAdapter, ConsumerGroup "walbox_bench",
//     PollInterval -poll (100ms, the polling baseline's; library default 1s),
//     InitializeSchema true.
//   - NATS publisher (watermill-nats v2 pkg/nats, the documented JetStream
//     publisher; pkg/jetstream is marked beta): JetStream enabled,
//     TrackMsgId true (Nats-Msg-Id = Watermill message UUID, i.e. the UUID the
//     producer gave the message, carried through the envelope),
//     AutoProvision false (the benchmark creates the stream).
//
// Library defaults kept:
//   - SQL subscriber: SubscribeBatchSize 100 (rows per SELECT, one REPEATABLE
//     READ transaction per batch, offset stored once per batch), AckDeadline
//     30s, ResendInterval 1s, RetryInterval 1s, default BackoffManager (sleep
//     PollInterval only when a query returned no row), payload column JSON,
//     schema initialised in a transaction under an advisory lock.
//   - The subscriber hands the rows of a batch to the router one at a time and
//     waits for each message's ack before sending the next.
//   - Router: CloseTimeout 30s, no middleware (no retry, no poison queue);
//     forwarder AckWhenCannotUnwrap false.
//   - NATS publisher: NATSMarshaler (data = the original payload bytes,
//     headers _watermill_message_uuid + metadata), DefaultSubjectCalculator
//     (subject = topic unchanged), synchronous js.PublishMsg (each message
//     waits for its JetStream PubAck), no extra PublishOptions, nats.go
//     connection defaults.
//   - database/sql pool defaults for the forwarder (pgx stdlib driver).
//   - Logger: watermill.NewStdLogger(false, false): info and errors to
//     stderr, debug/trace (the per-message lines) discarded.
package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmnats "github.com/ThreeDotsLabs/watermill-nats/v2/pkg/nats"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/nats-io/nats.go"
)

const consumerGroup = "walbox_bench"

func usage() {
	fmt.Fprintln(os.Stderr, `usage:
  wm load    -pg URL -subject S -n N [-txn 10] [-conns 4] [-payload-bytes 200] [-forwarder-topic T]
  wm forward -pg URL -nats URL [-poll 100ms] [-forwarder-topic T]
  wm produce -pg URL -subject S -rate R -for D [-payload-bytes 200] [-sync-commit on|off] [-forwarder-topic T]`)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(1)
	}
	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "load":
		err = runLoad(args)
	case "forward":
		err = runForward(args)
	case "produce":
		err = runProduce(args)
	case "-h", "-help", "--help", "help":
		usage()
		return
	default:
		usage()
		err = fmt.Errorf("unknown subcommand %q", cmd)
	}
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "wm: %v\n", err)
		os.Exit(1)
	}
}

type common struct {
	pg, topic string
	payload   int
}

func commonFlags(name string, c *common) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.StringVar(&c.pg, "pg", "", "PostgreSQL URL")
	fs.StringVar(&c.topic, "forwarder-topic", "walbox_bench_forwarder", "SQL topic (table watermill_<topic>) the forwarder consumes")
	fs.IntVar(&c.payload, "payload-bytes", 200, "payload size in bytes")
	return fs
}

func parse(fs *flag.FlagSet, args []string, c *common) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if c.pg == "" {
		return errors.New("-pg is required")
	}
	return nil
}

// payload is the benchmark's event body; the benchmark parses id and ts.
func payload(i, size int, ts int64) string {
	head := fmt.Sprintf(`{"id": "%09d", "ts": "%019d", "pad": "`, i%1_000_000_000, ts)
	const tail = `", "kind": "bench.event"}`
	n := max(0, size-len(head)-len(tail))
	return head + strings.Repeat("x", n) + tail
}

func logger() watermill.LoggerAdapter { return watermill.NewStdLogger(false, false) }

func schema() wmsql.DefaultPostgreSQLSchema { return wmsql.DefaultPostgreSQLSchema{} }

func offsets() wmsql.DefaultPostgreSQLOffsetsAdapter {
	return wmsql.DefaultPostgreSQLOffsetsAdapter{}
}

func openDB(url string) (*sql.DB, error) {
	db, err := sql.Open("pgx", url)
	if err != nil {
		return nil, err
	}
	return db, nil
}

// initSchema creates the messages and offsets tables of topic (what the
// subscriber's InitializeSchema does), so producers can write inside their
// own transactions: the SQL publisher refuses AutoInitializeSchema on a tx.
func initSchema(db *sql.DB, topic string) error {
	sub, err := wmsql.NewSubscriber(wmsql.BeginnerFromStdSQL(db), wmsql.SubscriberConfig{
		ConsumerGroup:    consumerGroup,
		SchemaAdapter:    schema(),
		OffsetsAdapter:   offsets(),
		InitializeSchema: true,
	}, watermill.NopLogger{})
	if err != nil {
		return err
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(topic); err != nil {
		return fmt.Errorf("initialize schema: %w", err)
	}
	return nil
}

// publishInTx is the outbox write: BEGIN, publish msgs to destination topic
// subject through the forwarder publisher bound to the transaction, COMMIT.
func publishInTx(ctx context.Context, begin func(context.Context, *sql.TxOptions) (*sql.Tx, error), topic, subject string, msgs []*message.Message) error {
	tx, err := begin(ctx, nil)
	if err != nil {
		return fmt.Errorf("begin: %w", err)
	}
	pub, err := wmsql.NewPublisher(wmsql.TxFromStdSQL(tx), wmsql.PublisherConfig{SchemaAdapter: schema()}, watermill.NopLogger{})
	if err != nil {
		_ = tx.Rollback()
		return err
	}
	fp := forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: topic})
	if err := fp.Publish(subject, msgs...); err != nil {
		_ = tx.Rollback()
		return fmt.Errorf("publish: %w", err)
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("commit: %w", err)
	}
	return nil
}

func printJSON(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	_, err = fmt.Println(string(b))
	return err
}

// ---- load ----

func runLoad(args []string) error {
	var c common
	fs := commonFlags("load", &c)
	subject := fs.String("subject", "", "destination topic (NATS subject)")
	n := fs.Int("n", 0, "number of messages")
	txn := fs.Int("txn", 10, "messages per transaction")
	conns := fs.Int("conns", 4, "parallel connections")
	if err := parse(fs, args, &c); err != nil {
		return err
	}
	if *subject == "" || *n <= 0 || *txn <= 0 || *conns <= 0 {
		return errors.New("-subject, -n > 0, -txn > 0 and -conns > 0 are required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	db, err := openDB(c.pg)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(*conns)
	db.SetMaxIdleConns(*conns)
	if err := initSchema(db, c.topic); err != nil {
		return err
	}
	if err := warm(ctx, db, *conns); err != nil {
		return err
	}

	var next atomic.Int64
	var wg sync.WaitGroup
	var errOnce sync.Once
	var loadErr error
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now()
	for range *conns {
		wg.Go(func() {
			for {
				first := int(next.Add(int64(*txn))) - *txn
				if first >= *n || wctx.Err() != nil {
					return
				}
				msgs := make([]*message.Message, 0, *txn)
				for i := first; i < min(first+*txn, *n); i++ {
					msgs = append(msgs, message.NewMessage(watermill.NewUUID(), []byte(payload(i, c.payload, 0))))
				}
				if err := publishInTx(wctx, db.BeginTx, c.topic, *subject, msgs); err != nil {
					errOnce.Do(func() { loadErr = err; cancel() })
					return
				}
			}
		})
	}
	wg.Wait()
	if loadErr != nil {
		return loadErr
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return printJSON(map[string]any{"events": *n, "seconds": time.Since(start).Seconds()})
}

// warm opens k connections of db's pool (MaxIdleConns must be >= k).
func warm(ctx context.Context, db *sql.DB, k int) error {
	cs := make([]*sql.Conn, 0, k)
	defer func() {
		for _, c := range cs {
			_ = c.Close()
		}
	}()
	for range k {
		c, err := db.Conn(ctx)
		if err != nil {
			return fmt.Errorf("connect: %w", err)
		}
		cs = append(cs, c)
		if err := c.PingContext(ctx); err != nil {
			return fmt.Errorf("ping: %w", err)
		}
	}
	return nil
}

// ---- forward ----

func runForward(args []string) error {
	var c common
	fs := commonFlags("forward", &c)
	natsURL := fs.String("nats", "", "NATS URL")
	poll := fs.Duration("poll", 100*time.Millisecond, "SQL subscriber PollInterval")
	if err := parse(fs, args, &c); err != nil {
		return err
	}
	if *natsURL == "" {
		return errors.New("-nats is required")
	}
	if *poll <= 0 {
		return errors.New("-poll must be positive")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := logger()

	db, err := openDB(c.pg)
	if err != nil {
		return err
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("postgres: %w", err)
	}

	sub, err := wmsql.NewSubscriber(wmsql.BeginnerFromStdSQL(db), wmsql.SubscriberConfig{
		ConsumerGroup:    consumerGroup,
		PollInterval:     *poll,
		SchemaAdapter:    schema(),
		OffsetsAdapter:   offsets(),
		InitializeSchema: true,
	}, log)
	if err != nil {
		return fmt.Errorf("sql subscriber: %w", err)
	}
	defer sub.Close()

	pub, err := wmnats.NewPublisher(wmnats.PublisherConfig{
		URL:         *natsURL,
		NatsOptions: []nats.Option{nats.Name("walbox-bench-watermill")},
		Marshaler:   &wmnats.NATSMarshaler{},
		JetStream: wmnats.JetStreamConfig{
			AutoProvision: false,
			TrackMsgId:    true,
		},
	}, log)
	if err != nil {
		return fmt.Errorf("nats publisher: %w", err)
	}
	defer pub.Close()

	fwd, err := forwarder.NewForwarder(sub, pub, log, forwarder.Config{ForwarderTopic: c.topic})
	if err != nil {
		return fmt.Errorf("forwarder: %w", err)
	}
	runErr := make(chan error, 1)
	go func() { runErr <- fwd.Run(context.Background()) }()

	select {
	case <-fwd.Running():
	case err := <-runErr:
		return fmt.Errorf("forwarder: %w", errOrStopped(err))
	case <-ctx.Done():
		_ = fwd.Close()
		return nil
	}
	fmt.Println("ready")

	select {
	case err := <-runErr:
		return fmt.Errorf("forwarder stopped: %w", errOrStopped(err))
	case <-ctx.Done():
	}
	if err := fwd.Close(); err != nil {
		return fmt.Errorf("close forwarder: %w", err)
	}
	return nil
}

func errOrStopped(err error) error {
	if err == nil {
		return errors.New("stopped")
	}
	return err
}

// ---- produce ----

func runProduce(args []string) error {
	var c common
	fs := commonFlags("produce", &c)
	subject := fs.String("subject", "", "destination topic (NATS subject)")
	rate := fs.Float64("rate", 0, "events per second (all producers)")
	dur := fs.Duration("for", 0, "how long to produce")
	syncCommit := fs.String("sync-commit", "", "synchronous_commit of the producer sessions (empty: server/URL default)")
	if err := parse(fs, args, &c); err != nil {
		return err
	}
	if *subject == "" || *rate <= 0 || *dur <= 0 {
		return errors.New("-subject, -rate > 0 and -for > 0 are required")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	producers := max(4, int(math.Ceil(*rate/125)))
	interval := time.Duration(float64(producers) / *rate * float64(time.Second))

	db, err := openDB(c.pg)
	if err != nil {
		return err
	}
	defer db.Close()
	db.SetMaxOpenConns(producers)
	db.SetMaxIdleConns(producers)
	if err := initSchema(db, c.topic); err != nil {
		return err
	}
	// One dedicated connection per producer, all open before the clock starts.
	conns := make([]*sql.Conn, producers)
	defer func() {
		for _, cn := range conns {
			if cn != nil {
				_ = cn.Close()
			}
		}
	}()
	for i := range conns {
		cn, err := db.Conn(ctx)
		if err != nil {
			return fmt.Errorf("connect: %w", err)
		}
		conns[i] = cn
		if *syncCommit != "" {
			if _, err := cn.ExecContext(ctx, "SELECT set_config('synchronous_commit', $1, false)", *syncCommit); err != nil {
				return fmt.Errorf("synchronous_commit: %w", err)
			}
		}
		if err := cn.PingContext(ctx); err != nil {
			return fmt.Errorf("ping: %w", err)
		}
	}

	var (
		seq        atomic.Int64
		mu         sync.Mutex
		rtts       []time.Duration
		lastCommit atomic.Int64
		wg         sync.WaitGroup
		errOnce    sync.Once
		prodErr    error
	)
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	start := time.Now().Add(20 * time.Millisecond)
	end := start.Add(*dur)
	for p, cn := range conns {
		wg.Go(func() {
			// Spread the producers evenly over the interval.
			select {
			case <-time.After(time.Until(start.Add(interval * time.Duration(p) / time.Duration(producers)))):
			case <-wctx.Done():
				return
			}
			tk := time.NewTicker(interval)
			defer tk.Stop()
			mine := make([]time.Duration, 0, int(dur.Seconds()**rate)/producers+16)
			defer func() {
				mu.Lock()
				rtts = append(rtts, mine...)
				mu.Unlock()
			}()
			for time.Now().Before(end) {
				i := int(seq.Add(1) - 1)
				t0 := time.Now()
				msg := message.NewMessage(watermill.NewUUID(), []byte(payload(i, c.payload, t0.UnixNano())))
				if err := publishInTx(wctx, cn.BeginTx, c.topic, *subject, []*message.Message{msg}); err != nil {
					errOnce.Do(func() { prodErr = err; cancel() })
					return
				}
				t1 := time.Now()
				mine = append(mine, t1.Sub(t0))
				lastCommit.Store(t1.UnixNano())
				select {
				case <-tk.C:
				case <-wctx.Done():
					return
				}
			}
		})
	}
	wg.Wait()
	if prodErr != nil {
		return fmt.Errorf("producer: %w", prodErr)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	events := len(rtts)
	achieved := 0.0
	if events > 0 {
		if s := time.Unix(0, lastCommit.Load()).Sub(start).Seconds(); s > 0 {
			achieved = float64(events) / s
		}
	}
	slices.Sort(rtts)
	return printJSON(map[string]any{
		"events":        events,
		"achieved":      achieved,
		"insert_p50_ms": ms(quantile(rtts, 0.50)),
		"insert_p99_ms": ms(quantile(rtts, 0.99)),
	})
}

func quantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
