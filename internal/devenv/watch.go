package devenv

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// watcher reads the streams with ordered consumers (ephemeral, flow
// controlled, recreated by the client on a gap) and hands every stored
// message to the console.
type watcher struct {
	nc   *nats.Conn
	ccs  []jetstream.ConsumeContext
	once sync.Once
}

// watch starts one ordered consumer per stream, from the messages stored
// since since, so a run shows its own events only.
func watch(ctx context.Context, url string, streams []string, since time.Time, con *console) (*watcher, error) {
	nc, err := nats.Connect(url, nats.Name("walbox-dev-console"), nats.MaxReconnects(-1))
	if err != nil {
		return nil, fmt.Errorf("connect the event console to NATS: %w", err)
	}
	w := &watcher{nc: nc}
	js, err := jetstream.New(nc)
	if err != nil {
		w.stop()
		return nil, fmt.Errorf("event console: %w", err)
	}
	for _, name := range streams {
		cons, err := js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{
			DeliverPolicy: jetstream.DeliverByStartTimePolicy,
			OptStartTime:  &since,
		})
		if err != nil {
			w.stop()
			return nil, fmt.Errorf("event console: ordered consumer on stream %s: %w", name, err)
		}
		cc, err := cons.Consume(con.event)
		if err != nil {
			w.stop()
			return nil, fmt.Errorf("event console: consume stream %s: %w", name, err)
		}
		w.ccs = append(w.ccs, cc)
	}
	return w, nil
}

// stop ends the consumers and the connection; it may be called again.
func (w *watcher) stop() {
	w.once.Do(func() {
		for _, cc := range w.ccs {
			cc.Stop()
		}
		for _, cc := range w.ccs {
			select {
			case <-cc.Closed():
			case <-time.After(2 * time.Second):
			}
		}
		w.nc.Close()
	})
}
