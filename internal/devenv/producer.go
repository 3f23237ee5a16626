package devenv

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/walbox/walbox/cdc"
)

// maxProducerFailures is how many inserts in a row may fail (the database
// restarting, say) before the session stops with the error.
const maxProducerFailures = 10

// producer commits sample events at a steady rate, one transaction each,
// the way a service writes its outbox row next to its business rows.
type producer struct {
	url      string
	table    string // schema.table
	rate     float64
	log      zerolog.Logger
	produced *atomic.Int64
}

func (p *producer) run(ctx context.Context) error {
	t, err := cdc.ParseTableName(p.table)
	if err != nil {
		return fmt.Errorf("producer: %w", err)
	}
	insert := "INSERT INTO " + pgx.Identifier{t.Schema, t.Name}.Sanitize() +
		" (topic, aggregate_type, aggregate_id, event_type, partition_key, payload, headers) VALUES ($1, $2, $3, $4, $5, $6, $7)"

	interval := time.Duration(float64(time.Second) / p.rate)
	if interval <= 0 {
		interval = time.Nanosecond
	}
	tick := time.NewTicker(interval)
	defer tick.Stop()

	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.WithoutCancel(ctx))
		}
	}()
	failures := 0
	for i := 0; ; {
		err := func() error {
			if conn == nil || conn.IsClosed() {
				c, err := pgx.Connect(ctx, p.url)
				if err != nil {
					return fmt.Errorf("connect: %w", err)
				}
				conn = c
			}
			ev := sampleEvent(i)
			payload, err := json.Marshal(ev.payload)
			if err != nil {
				return fmt.Errorf("encode payload: %w", err)
			}
			headers := fmt.Sprintf(`{"traceparent": "00-%016x%016x-%016x-01"}`, rand.Uint64(), rand.Uint64(), rand.Uint64())
			_, err = conn.Exec(ctx, insert, ev.topic, ev.aggregateType, ev.aggregateID, ev.eventType, ev.aggregateID, payload, headers)
			if err != nil {
				return fmt.Errorf("insert into %s: %w", p.table, err)
			}
			return nil
		}()
		switch {
		case ctx.Err() != nil:
			return nil
		case err != nil:
			failures++
			p.log.Warn().Err(err).Int("failures_in_a_row", failures).Msg("sample producer: insert failed")
			if failures >= maxProducerFailures {
				return fmt.Errorf("sample producer: %d inserts failed in a row, last: %w", failures, err)
			}
		default:
			failures = 0
			i++
			p.produced.Add(1)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

type event struct {
	topic, aggregateType, aggregateID, eventType string
	payload                                      map[string]any
}

// sampleEvent is the i-th event of a small shop: every order is created,
// paid and shipped, so the ORDERS and PAYMENTS streams both fill and one
// order's events can be followed by its id.
func sampleEvent(i int) event {
	n := 1001 + i/3
	order := fmt.Sprintf("o-%d", n)
	amount := 500 + (n*7919)%20000
	switch i % 3 {
	case 0:
		return event{"orders.created", "order", order, "OrderCreated", map[string]any{
			"order_id": order, "customer_id": fmt.Sprintf("c-%03d", (n*37)%500), "amount_cents": amount,
		}}
	case 1:
		return event{"payments.settled", "order", order, "PaymentSettled", map[string]any{
			"order_id": order, "amount_cents": amount, "method": []string{"card", "sepa", "paypal"}[n%3],
		}}
	default:
		return event{"orders.shipped", "order", order, "OrderShipped", map[string]any{
			"order_id": order, "carrier": []string{"DHL", "UPS", "PostNL"}[n%3], "tracking": fmt.Sprintf("TRK%08d", (n*104729)%100000000),
		}}
	}
}
