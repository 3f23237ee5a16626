package jssink

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/busops"
)

// OpsConfig is what the operations commands' bus (OpenOps) needs of the
// configuration.
type OpsConfig struct {
	// Streams are the configured streams, the dead-letter stream last
	// (nats.streams, then nats.dlq.stream).
	Streams          []StreamSpec
	SubjectPrefix    string
	DLQSubjectPrefix string
	Router           relay.RouterOptions
	AckTimeout       time.Duration
	// RedactURL shows a server URL without its credentials.
	RedactURL func(string) string
	// Claim, when set, wraps the sink the commands publish through (the
	// claim check, relay/claim) and returns the size above which it moves
	// a payload, for the router's size check.
	Claim func(relay.Sink) (relay.Sink, int)
}

// Ops is JetStream as walbox's operations commands see it: a
// busops.Bus over the relay's own Sink.
type Ops struct {
	busops.Names
	cfg  OpsConfig
	nc   *nats.Conn
	js   jetstream.JetStream
	sink *Sink
	// pub is what Publish goes through: sink, or the claim check around it.
	pub        relay.Sink
	claimAbove int
}

// OpenOps wraps a connection for the commands; Close closes it.
func OpenOps(nc *nats.Conn, cfg OpsConfig) (*Ops, error) {
	sink, err := New(nc, cfg.AckTimeout)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(cfg.Streams))
	for i, sp := range cfg.Streams {
		names[i] = sp.Name
	}
	o := &Ops{Names: busops.NamesOf(names), cfg: cfg, nc: nc, js: sink.js, sink: sink, pub: sink}
	if cfg.Claim != nil {
		o.pub, o.claimAbove = cfg.Claim(sink)
	}
	return o, nil
}

var _ busops.Bus = (*Ops)(nil)

// Terms implements busops.Bus.
func (o *Ops) Terms() busops.Terms {
	return busops.Terms{Stream: "stream", Subject: "subject", Dedupes: true,
		NoCheck: "pass --no-check to rely on the duplicate window alone",
		Remove:  "delete them from", Removed: "deleted from"}
}

// StoredTail implements busops.Bus.
func (o *Ops) StoredTail(ctx context.Context, stream, source string, n int) (relay.StoredTail, error) {
	return o.sink.StoredTail(ctx, stream, source, n)
}

// Close implements busops.Bus.
func (o *Ops) Close() { o.nc.Close() }

// Routes implements busops.Bus: every configured stream must exist (walbox
// run creates them), the dead-letter stream's included.
func (o *Ops) Routes(ctx context.Context) ([]relay.Route, error) {
	var out []relay.Route
	for _, sp := range o.cfg.Streams {
		st, err := o.js.Stream(ctx, sp.Name)
		if err != nil {
			if errors.Is(err, jetstream.ErrStreamNotFound) {
				return nil, fmt.Errorf("stream %s does not exist on the server (walbox run creates it; or create it): %w", sp.Name, err)
			}
			return nil, fmt.Errorf("stream %s: %w", sp.Name, err)
		}
		out = append(out, relay.Route{Stream: sp.Name, Subjects: st.CachedInfo().Config.Subjects})
	}
	return out, nil
}

// Router implements busops.Bus.
func (o *Ops) Router(source string, routes []relay.Route) (*relay.Router, error) {
	rt, err := relay.NewRouterWithOptions(o.cfg.SubjectPrefix, source, routes, o.cfg.Router)
	if err != nil {
		return nil, err
	}
	rt.SetMaxPayload(o.sink.MaxPayload())
	rt.SetClaimThreshold(o.claimAbove)
	return rt, nil
}

// Destination implements busops.Bus: the stream the server stores subject
// in (any stream, configured or not), but not the dead-letter stream.
func (o *Ops) Destination(ctx context.Context, subject string) (string, string, error) {
	stream, err := o.js.StreamNameBySubject(ctx, subject)
	switch {
	case err != nil && !errors.Is(err, jetstream.ErrStreamNotFound):
		return "", "", fmt.Errorf("look up the stream of %s: %w", subject, err)
	case err != nil, stream == o.DLQ && !strings.HasPrefix(subject, o.cfg.DLQSubjectPrefix):
		return "", fmt.Sprintf("no stream captures %s yet (add it to nats.streams and restart walbox, or create the stream)", subject), nil
	}
	return stream, "", nil
}

// DeadLetter implements busops.Bus.
func (o *Ops) DeadLetter(rt *relay.Router, ev *cdc.Event, reason string) *relay.Msg {
	return rt.DeadLetter(ev, o.cfg.DLQSubjectPrefix, reason)
}

// Publish implements busops.Bus: with the expected stream dest, through
// the relay's Sink.
func (o *Ops) Publish(m *relay.Msg, dest string) (relay.Future, error) {
	m.SetHeader(jetstream.ExpectedStreamHeader, dest)
	return o.pub.Publish(m)
}

// ReadBack implements busops.Bus.
func (o *Ops) ReadBack(ctx context.Context, dest, source string, rr relay.ReadBackRange, fn func(relay.StoredEvent) bool) error {
	return o.sink.ReadBack(ctx, dest, source, rr, fn)
}

// Scan implements busops.Bus, headers only.
func (o *Ops) Scan(ctx context.Context, dest, filter string, since time.Time, fn func(relay.Header) error) error {
	st, err := o.js.Stream(ctx, dest)
	if err != nil {
		return fmt.Errorf("stream %s: %w", dest, err)
	}
	cc := jetstream.OrderedConsumerConfig{HeadersOnly: true, DeliverPolicy: jetstream.DeliverAllPolicy}
	if !since.IsZero() {
		cc.DeliverPolicy, cc.OptStartTime = jetstream.DeliverByStartTimePolicy, &since
	}
	if filter != "" {
		cc.FilterSubjects = []string{filter}
	}
	return consume(ctx, st, cc, 0, func(m jetstream.Msg, _ *jetstream.MsgMetadata) error {
		return fn(relay.Header(m.Headers()))
	})
}

// consume calls fn with the messages an ordered consumer cc of st
// delivers, up to limit (<= 0: all), until none is pending.
func consume(ctx context.Context, st jetstream.Stream, cc jetstream.OrderedConsumerConfig, limit int, fn func(jetstream.Msg, *jetstream.MsgMetadata) error) error {
	if st.CachedInfo().State.Msgs == 0 {
		return nil
	}
	name := st.CachedInfo().Config.Name
	cons, err := st.OrderedConsumer(ctx, cc)
	if err != nil {
		return fmt.Errorf("read %s: %w", name, err)
	}
	for n := 0; limit <= 0 || n < limit; {
		want := 1000
		if limit > 0 {
			want = min(want, limit-n)
		}
		batch, err := cons.Fetch(want, jetstream.FetchMaxWait(time.Second))
		if err != nil {
			return fmt.Errorf("read %s: %w", name, err)
		}
		got, pending := 0, uint64(1)
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err == nil {
				pending = md.NumPending
			}
			if err := fn(m, md); err != nil {
				return err
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) && !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, nats.ErrTimeout) {
			return fmt.Errorf("read %s: %w", name, err)
		}
		if got == 0 || pending == 0 {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		n += got
	}
	return nil
}

// dlqStream is the dead-letter stream: a retried dead letter is deleted.
type dlqStream struct {
	o  *Ops
	st jetstream.Stream
}

// DeadLetters implements busops.Bus.
func (o *Ops) DeadLetters(ctx context.Context) (busops.DLQ, error) {
	name := o.DLQ
	st, err := o.js.Stream(ctx, name)
	if err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, fmt.Errorf("dead-letter stream %s does not exist (walbox run creates it; nats.dlq.stream names it)", name)
		}
		return nil, fmt.Errorf("stream %s: %w", name, err)
	}
	return &dlqStream{o: o, st: st}, nil
}

func (d *dlqStream) List(ctx context.Context, limit int, data bool) ([]busops.DeadLetter, uint64, error) {
	var out []busops.DeadLetter
	cc := jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy, HeadersOnly: !data}
	err := consume(ctx, d.st, cc, limit, func(m jetstream.Msg, md *jetstream.MsgMetadata) error {
		dl := busops.NewDeadLetter(0, time.Time{}, m.Subject(), relay.Header(m.Headers()))
		if md != nil {
			dl.Seq, dl.Time = md.Sequence.Stream, md.Timestamp
		}
		if data {
			dl.Data = m.Data()
		}
		out = append(out, dl)
		return nil
	})
	return out, d.st.CachedInfo().State.Msgs, err
}

func (d *dlqStream) Pick(ctx context.Context, seqs []uint64) ([]busops.DeadLetter, error) {
	var out []busops.DeadLetter
	for _, seq := range seqs {
		raw, err := d.st.GetMsg(ctx, seq)
		if err != nil {
			return nil, fmt.Errorf("dead letter %d of %s: %w", seq, d.o.DLQ, err)
		}
		dl := busops.NewDeadLetter(raw.Sequence, raw.Time, raw.Subject, relay.Header(raw.Header))
		dl.Data = raw.Data
		out = append(out, dl)
	}
	return out, nil
}

func (d *dlqStream) Retried(ctx context.Context, dl busops.DeadLetter, _ string) error {
	if err := d.st.DeleteMsg(ctx, dl.Seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
		return fmt.Errorf("delete %d from %s: %w", dl.Seq, d.o.DLQ, err)
	}
	return nil
}

func (d *dlqStream) Count(context.Context) (uint64, error) { return d.st.CachedInfo().State.Msgs, nil }

func (d *dlqStream) Close(context.Context) error { return nil }

// Check implements busops.Bus: the server answers with JetStream, and each
// configured stream exists (or walbox creates it) as configured, durable.
func (o *Ops) Check(ctx context.Context, report busops.Report) {
	report("nats.connect", busops.OK, fmt.Sprintf("connected to %s (nats-server %s)", o.cfg.RedactURL(o.nc.ConnectedUrl()), o.nc.ConnectedServerVersion()), "")
	ai, err := o.js.AccountInfo(ctx)
	if err != nil {
		fix := "check that the account may use JetStream"
		if errors.Is(err, jetstream.ErrJetStreamNotEnabled) || errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) {
			fix = "enable JetStream: nats-server -js, or `jetstream { store_dir: /data }` in the server config (and for the account, with accounts)"
		}
		report("nats.jetstream", busops.Fail, fmt.Sprintf("JetStream is not available: %v", err), fix)
		return
	}
	report("nats.jetstream", busops.OK, fmt.Sprintf("JetStream enabled: %d streams, %s stored", ai.Streams, busops.HumanBytes(int64(ai.Store))), "")
	for i, sp := range o.cfg.Streams {
		key := fmt.Sprintf("nats.streams[%d]", i)
		if i == len(o.cfg.Streams)-1 {
			key = "nats.dlq.stream"
		}
		o.checkStream(ctx, sp, key, report)
		o.checkReplicas(sp, key, report)
	}
}

// checkReplicas compares a stream's replicas with the NATS servers walbox
// sees: replicas above 1 need a JetStream cluster with at least that many
// nodes, or creating the stream fails (and walbox run exits with this fix).
func (o *Ops) checkReplicas(sp StreamSpec, key string, report busops.Report) {
	name := "nats.stream." + sp.Name + ".replicas"
	replicas := max(sp.Replicas, 1)
	cluster, servers := o.nc.ConnectedClusterName(), len(o.nc.Servers())
	switch {
	case replicas > 1 && cluster == "":
		report(name, busops.Fail, fmt.Sprintf("%s.replicas is %d, but the NATS server is not clustered", key, replicas),
			fmt.Sprintf("set %s.replicas: 1 for a single server (durable with sync_interval: always), or run a NATS cluster of %d or more nodes", key, replicas))
	case replicas > servers:
		report(name, busops.Warn, fmt.Sprintf("%s.replicas is %d, and walbox sees %d server(s) of cluster %s", key, replicas, servers, cluster),
			fmt.Sprintf("add servers to cluster %s, or lower %s.replicas", cluster, key))
	case cluster == "":
		report(name, busops.OK, fmt.Sprintf("R%d on a single server", replicas), "")
	default:
		report(name, busops.OK, fmt.Sprintf("R%d on cluster %s (%d servers seen)", replicas, cluster, servers), "")
	}
}

func (o *Ops) checkStream(ctx context.Context, sp StreamSpec, key string, report busops.Report) {
	name := "nats.stream." + sp.Name
	// What the stream has (or, before walbox created it, will have).
	window, replicas, memory := sp.DuplicateWindow, max(sp.Replicas, 1), sp.Storage == "memory"
	var info *jetstream.StreamInfo
	st, err := o.js.Stream(ctx, sp.Name)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && sp.Manage:
		report(name, busops.OK, fmt.Sprintf("stream %s does not exist yet: walbox run creates it (%s)", sp.Name, strings.Join(sp.Subjects, ", ")), "")
	case errors.Is(err, jetstream.ErrStreamNotFound):
		report(name, busops.Fail, fmt.Sprintf("stream %s does not exist and %s.manage is false (walbox only checks it)", sp.Name, key),
			fmt.Sprintf("create it (nats stream add %s --subjects %q ...), or set %s.manage: true", sp.Name, strings.Join(sp.Subjects, ","), key))
		return
	case err != nil:
		report(name, busops.Fail, fmt.Sprintf("cannot read stream %s: %v", sp.Name, err), "")
		return
	default:
		info = st.CachedInfo()
		window, replicas, memory = info.Config.Duplicates, max(info.Config.Replicas, 1), info.Config.Storage == jetstream.MemoryStorage
		checkStreamConfig(sp, info, key, report)
	}
	if key == "nats.dlq.stream" {
		return // walbox creates the dead-letter stream itself: R1, 2m window
	}
	o.checkPath(sp, info, key, report)
	if window < 2*time.Minute {
		report(name+".duplicate_window", busops.Warn, fmt.Sprintf("duplicate window %s: a relay down (or restarting) for longer may republish events JetStream already stored, beyond what the resume check sees", window),
			fmt.Sprintf("set %s.duplicate_window to 2m or more, longer than the downtime you expect", key))
	} else {
		report(name+".duplicate_window", busops.OK, fmt.Sprintf("duplicate window %s", window), "")
	}
	switch {
	case memory:
		report(name+".durability", busops.Warn, fmt.Sprintf("stream %s keeps messages in memory: acked events are lost when the server stops", sp.Name),
			fmt.Sprintf("use %s.storage: file and replicas: 3", key))
	case replicas >= 3:
		report(name+".durability", busops.OK, fmt.Sprintf("R%d file stream: an ack means a quorum stored it", replicas), "")
	default:
		report(name+".durability", busops.Warn, fmt.Sprintf("R%d stream: acks are durable only with sync_interval: always on the server; use replicas: 3 for durability", replicas),
			fmt.Sprintf("set %s.replicas: 3 on a JetStream cluster, or sync_interval: always in the server's jetstream block (JetStream does not report it to clients)", key))
	}
}

// checkPath says how walbox publishes to the stream, and what fast batches
// would need where it publishes per message.
func (o *Ops) checkPath(sp StreamSpec, info *jetstream.StreamInfo, key string, report busops.Report) {
	name := "nats.stream." + sp.Name + ".publish"
	version := o.nc.ConnectedServerVersion()
	if sp.Atomic && o.checkAtomicPath(sp, info, name, key, version, report) {
		return
	}
	if sp.Manage && info != nil && !info.Config.AllowBatchPublish && sp.FastBatch && sp.NoBatch == "" && FastBatchServer(version) {
		report(name, busops.OK, "per message until walbox run updates the stream with allow_batched; then fast batches while the stream is busy", "")
		return
	}
	p := PathFor(sp, info, version)
	switch {
	case p.Batch:
		report(name, busops.OK, "fast batches while the stream is busy (one flow ack per up to 256 messages), per message otherwise", "")
	case !sp.FastBatch || sp.NoBatch != "":
		report(name, busops.OK, "per message: "+p.Why, "")
	case !FastBatchServer(version):
		report(name, busops.Warn, "per message: "+p.Why, "upgrade every node of the NATS cluster to nats-server 2.14 or later; walbox then sets allow_batched on the streams it manages")
	default:
		report(name, busops.Warn, "per message: "+p.Why,
			fmt.Sprintf("set allow_batched: true on stream %s (a stream walbox does not manage; or set %s.manage: true), or nats.fast_batch: false to silence this", sp.Name, key))
	}
}

// checkAtomicPath reports the path of a stream with nats.atomic_transactions
// on: atomic batches, or why not and what enabling them would need. It
// returns false where the stream is not atomic and nothing needs saying
// beyond the fast-batch check.
func (o *Ops) checkAtomicPath(sp StreamSpec, info *jetstream.StreamInfo, name, key, version string, report busops.Report) bool {
	const what = "each transaction in an atomic batch: a consumer never sees part of one (split at 1,000 messages, the server's batch limit)"
	if sp.Manage && info != nil && !info.Config.AllowAtomicPublish && AtomicServer(version) {
		report(name, busops.OK, "per message until walbox run updates the stream with allow_atomic; then "+what, "")
		return true
	}
	p := PathFor(sp, info, version)
	switch {
	case p.Atomic:
		report(name, busops.OK, what, "")
	case !AtomicServer(version):
		report(name, busops.Warn, p.Why, "upgrade every node of the NATS cluster to nats-server 2.12.1 or later; walbox then sets allow_atomic on the streams it manages")
	case info != nil && info.Config.Mirror != nil:
		return false
	default:
		report(name, busops.Warn, p.Why,
			fmt.Sprintf("set allow_atomic: true on stream %s (a stream walbox does not manage; or set %s.manage: true), or nats.atomic_transactions: false", sp.Name, key))
	}
	return true
}

// checkStreamConfig compares an existing stream with its configuration.
func checkStreamConfig(sp StreamSpec, info *jetstream.StreamInfo, key string, report busops.Report) {
	name := "nats.stream." + sp.Name
	var uncovered []string
	for _, want := range sp.Subjects {
		covered := false
		for _, have := range info.Config.Subjects {
			covered = covered || FilterCovers(have, want)
		}
		if !covered {
			uncovered = append(uncovered, want)
		}
	}
	actualStorage := "file"
	if info.Config.Storage == jetstream.MemoryStorage {
		actualStorage = "memory"
	}
	switch {
	case len(uncovered) > 0 && sp.Manage:
		report(name, busops.Warn, fmt.Sprintf("stream %s captures %s, not %s; walbox run will update its subjects", sp.Name, strings.Join(info.Config.Subjects, ", "), strings.Join(uncovered, ", ")), "")
	case len(uncovered) > 0:
		report(name, busops.Fail, fmt.Sprintf("stream %s captures %s, not %s (configured in %s.subjects): those events would be dead-lettered", sp.Name, strings.Join(info.Config.Subjects, ", "), strings.Join(uncovered, ", "), key),
			fmt.Sprintf("add the subjects to the stream (nats stream edit %s --subjects ...), or fix %s.subjects", sp.Name, key))
	case sp.Manage && sp.Storage != "" && sp.Storage != actualStorage:
		report(name, busops.Fail, fmt.Sprintf("stream %s has %s storage but %s.storage says %s; JetStream cannot change a stream's storage", sp.Name, actualStorage, key, sp.Storage),
			fmt.Sprintf("set %s.storage: %s, or delete and recreate the stream", key, actualStorage))
	default:
		report(name, busops.OK, fmt.Sprintf("stream %s captures %s (%d messages)", sp.Name, strings.Join(info.Config.Subjects, ", "), info.State.Msgs), "")
	}
}

// FilterCovers reports whether every subject want matches is matched by
// have (both may hold the wildcards * and >).
func FilterCovers(have, want string) bool {
	ht, wt := strings.Split(have, "."), strings.Split(want, ".")
	for i, h := range ht {
		if h == ">" {
			return len(wt) > i
		}
		if i >= len(wt) || wt[i] == ">" {
			return false
		}
		if h != "*" && h != wt[i] {
			return false
		}
	}
	return len(ht) == len(wt)
}
