package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// pollRelayArg, as the first argument, makes this binary run the polling
// baseline: the outbox worker as the outbox design documents describe it.
const pollRelayArg = "__polling-relay"

// Polling baseline settings, from the outbox design documents: batches of
// 200 oldest unprocessed rows locked with FOR UPDATE SKIP LOCKED, publish,
// mark processed, poll every 100 ms.
const (
	pollBatch    = 200
	pollInterval = 100 * time.Millisecond
)

// The two polling relays. Both lock a batch of the 200 oldest unprocessed
// rows with FOR UPDATE SKIP LOCKED and mark it processed with one UPDATE in
// that transaction, after the acks.
//
//   - pollDesign is the worker of the outbox design documents as written:
//     one poll every 100 ms; each event published and its ack awaited
//     before the next ("TRY publish, ON success mark processed").
//   - pollTuned is what a careful engineer would make of it: the whole
//     batch published asynchronously (200 in flight, then every ack
//     awaited), and a full batch followed by the next poll at once; the
//     100 ms sleep only after a poll that found less than a full batch.
const (
	pollDesign = "design"
	pollTuned  = "tuned"
)

// runPollRelay runs a polling relay until SIGTERM.
func runPollRelay(mode, dbURL, natsURL string) int {
	if mode != pollDesign && mode != pollTuned {
		fmt.Fprintf(os.Stderr, "polling relay: unknown mode %q (want %s or %s)\n", mode, pollDesign, pollTuned)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	if err := pollRelay(ctx, mode == pollTuned, dbURL, natsURL); err != nil && !errors.Is(err, context.Canceled) {
		fmt.Fprintln(os.Stderr, "polling relay:", err)
		return 1
	}
	return 0
}

func pollRelay(ctx context.Context, tuned bool, dbURL, natsURL string) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	nc, err := nats.Connect(natsURL, nats.Name("walbox-bench-polling-relay"))
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(2*pollBatch))
	if err != nil {
		return err
	}
	ids := make([]string, 0, pollBatch)
	futures := make([]jetstream.PubAckFuture, 0, pollBatch)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		n, err := pollOnce(ctx, tuned, pool, js, &ids, &futures)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			fmt.Fprintln(os.Stderr, "polling relay: batch failed, retrying:", err)
			n = 0 // back off like an empty poll
		}
		if tuned && n == pollBatch {
			continue
		}
		wait := tick.C
		if tuned {
			wait = time.After(pollInterval)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-wait:
		}
	}
}

// pollOnce locks, publishes and marks one batch; it returns its size.
func pollOnce(ctx context.Context, tuned bool, pool *pgxpool.Pool, js jetstream.JetStream, ids *[]string, futures *[]jetstream.PubAckFuture) (int, error) {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin: %w", err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // after Commit it is a no-op
	rows, err := tx.Query(ctx, `SELECT id::text, topic, payload::text FROM outbox_events
		WHERE NOT processed ORDER BY created_at LIMIT $1 FOR UPDATE SKIP LOCKED`, pollBatch)
	if err != nil {
		return 0, fmt.Errorf("select batch: %w", err)
	}
	*ids, *futures = (*ids)[:0], (*futures)[:0]
	var id, topic string
	var payload []byte
	_, err = pgx.ForEachRow(rows, []any{&id, &topic, &payload}, func() error {
		m := &nats.Msg{Subject: topic, Data: append([]byte(nil), payload...), Header: nats.Header{"Nats-Msg-Id": []string{id}}}
		if !tuned {
			if _, err := js.PublishMsg(ctx, m); err != nil {
				return fmt.Errorf("publish: %w", err)
			}
			*ids = append(*ids, id)
			return nil
		}
		f, err := js.PublishMsgAsync(m)
		if err != nil {
			return fmt.Errorf("publish: %w", err)
		}
		*ids, *futures = append(*ids, id), append(*futures, f)
		return nil
	})
	if err != nil {
		return 0, err
	}
	for _, f := range *futures {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return 0, fmt.Errorf("publish ack: %w", err)
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	if len(*ids) == 0 {
		return 0, nil
	}
	if _, err := tx.Exec(ctx, `UPDATE outbox_events SET processed = true, processed_at = now()
		WHERE id = ANY($1::uuid[]) AND NOT processed`, *ids); err != nil {
		return 0, fmt.Errorf("mark processed: %w", err)
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit: %w", err)
	}
	return len(*ids), nil
}
