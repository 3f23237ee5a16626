package outboxtest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Load describes concurrent producers writing outbox rows.
type Load struct {
	Producers int      // concurrent producers (default 8)
	MinRows   int      // rows per transaction, at least (default 1)
	MaxRows   int      // rows per transaction, at most (default 50)
	Rollback  float64  // share of transactions rolled back (default 0.1)
	Topics    []string // topics to spread rows over
	Table     string   // table to insert into (default outbox_events)
	// Txns stops each producer after this many transactions (0: until ctx ends).
	Txns int
	// Rate limits each producer to this many transactions per second (0: no limit).
	Rate float64
	// Keys, when > 0, gives each row an aggregate_id of k0..k<Keys-1>: the
	// partition key of Kafka records (per-key order).
	Keys int
}

// Result is what the producers did.
type Result struct {
	Committed  atomic.Int64 // rows committed
	RolledBack []string     // ids of rows whose transaction rolled back
	Errors     atomic.Int64 // transactions that failed (e.g. Postgres restarting); their rows did not commit
	mu         sync.Mutex
}

// Run produces until ctx ends or every producer did Txns transactions.
// Transactions that fail because the database is away are retried later;
// their rows are counted neither as committed nor as rolled back unless the
// outcome is known (the witness slot is the judge of what committed).
func (l Load) Run(ctx context.Context, pool *pgxpool.Pool) *Result {
	if l.Producers <= 0 {
		l.Producers = 8
	}
	if l.MinRows <= 0 {
		l.MinRows = 1
	}
	if l.MaxRows < l.MinRows {
		l.MaxRows = 50
	}
	if l.Table == "" {
		l.Table = "outbox_events"
	}
	if len(l.Topics) == 0 {
		l.Topics = []string{"orders.created", "orders.paid", "payments.settled"}
	}
	res := &Result{}
	var wg sync.WaitGroup
	for p := 0; p < l.Producers; p++ {
		wg.Add(1)
		go func(p int) {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(p), uint64(time.Now().UnixNano())))
			var tick *time.Ticker
			if l.Rate > 0 {
				tick = time.NewTicker(time.Duration(float64(time.Second) / l.Rate))
				defer tick.Stop()
			}
			for n := 0; l.Txns == 0 || n < l.Txns; n++ {
				if tick != nil {
					select {
					case <-ctx.Done():
						return
					case <-tick.C:
					}
				}
				if ctx.Err() != nil {
					return
				}
				rows := l.MinRows + rng.IntN(l.MaxRows-l.MinRows+1)
				rollback := rng.Float64() < l.Rollback
				ids, err := l.txn(ctx, pool, rng, p, rows, rollback)
				switch {
				case err != nil:
					res.Errors.Add(1)
					if ctx.Err() == nil {
						time.Sleep(50 * time.Millisecond)
					}
					n-- // try again: a failed transaction is not a rolled-back one
				case rollback:
					res.mu.Lock()
					res.RolledBack = append(res.RolledBack, ids...)
					res.mu.Unlock()
				default:
					res.Committed.Add(int64(len(ids)))
				}
			}
		}(p)
	}
	wg.Wait()
	return res
}

func (l Load) txn(ctx context.Context, pool *pgxpool.Pool, rng *rand.Rand, producer, rows int, rollback bool) ([]string, error) {
	tctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	tx, err := pool.Begin(tctx)
	if err != nil {
		return nil, err
	}
	defer tx.Rollback(tctx)
	ids := make([]string, rows)
	batch := &pgx.Batch{}
	for i := range ids {
		id, _ := uuid.NewV7()
		ids[i] = id.String()
		topic := l.Topics[rng.IntN(len(l.Topics))]
		payload := fmt.Sprintf(`{"producer":%d,"n":%d,"pad":"%s"}`, producer, i, "x")
		if l.Keys > 0 {
			batch.Queue(fmt.Sprintf("INSERT INTO %s (id, topic, payload, aggregate_id) VALUES ($1, $2, $3, $4)", l.Table),
				ids[i], topic, payload, fmt.Sprintf("k%d", rng.IntN(l.Keys)))
			continue
		}
		batch.Queue(fmt.Sprintf("INSERT INTO %s (id, topic, payload) VALUES ($1, $2, $3)", l.Table), ids[i], topic, payload)
	}
	if err := tx.SendBatch(tctx, batch).Close(); err != nil {
		return nil, err
	}
	// Business rows would go here; the outbox row commits with them or not at all.
	if rollback {
		return ids, tx.Rollback(tctx)
	}
	return ids, tx.Commit(tctx)
}
