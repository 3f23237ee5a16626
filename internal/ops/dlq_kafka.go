package ops

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/walbox/walbox/consumer"
	"github.com/walbox/walbox/internal/config"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/kafkasink"
)

// Kafka cannot delete one record of a topic. A retried dead letter is
// marked instead: `walbox dlq retry` appends a marker record to the
// dead-letter topic, in the dead letter's partition, whose header
// Walbox-Dlq-Retried holds the retried record's offset; `walbox dlq list`
// hides the records a marker names and the markers. It then commits, for
// the consumer group walbox-dlq, each partition's offset past the retried
// records and markers that precede the first dead letter still waiting,
// so that list starts reading there.
const headerDLQRetried = "Walbox-Dlq-Retried"

// kafkaDLQPart is what one partition of the dead-letter topic holds past
// the group's committed offset.
type kafkaDLQPart struct {
	committed, end int64
	handled        map[int64]bool // retried dead letters and markers
}

// kafkaDLQ is the dead-letter topic as list and retry see it.
type kafkaDLQ struct {
	topic   string
	pending []DeadLetter // not retried, by partition and offset
	parts   map[int32]*kafkaDLQPart
}

// readKafkaDLQ reads the dead-letter topic from the committed offsets of
// group walbox-dlq (or its start) to its end.
func readKafkaDLQ(ctx context.Context, cfg config.Config, adm *kadm.Client) (*kafkaDLQ, error) {
	topic := cfg.Kafka.DLQTopic
	spans, exists, err := topicSpans(ctx, adm, topic, time.Time{})
	if err != nil {
		return nil, err
	}
	if !exists {
		return nil, fmt.Errorf("dead-letter topic %s does not exist (walbox run creates it; kafka.dlq_topic names it)", topic)
	}
	committed, err := adm.FetchOffsets(ctx, kafkaGroupDLQ)
	if errors.Is(err, kerr.GroupIDNotFound) {
		committed, err = nil, nil // nothing retried yet
	}
	if err != nil {
		return nil, fmt.Errorf("read the offsets group %s committed on %s: %w", kafkaGroupDLQ, topic, err)
	}
	d := &kafkaDLQ{topic: topic, parts: map[int32]*kafkaDLQPart{}}
	for p, s := range spans {
		if c, ok := committed.Lookup(topic, p); ok && c.Err == nil && c.At > s.from {
			s.from = min(c.At, s.to)
			spans[p] = s
		}
		d.parts[p] = &kafkaDLQPart{committed: s.from, end: s.to, handled: map[int64]bool{}}
	}
	var all []DeadLetter
	err = readKafka(ctx, cfg, topic, spans, func(r *kgo.Record) error {
		part := d.parts[r.Partition]
		h := kafkasink.FromKafkaHeaders(r.Headers)
		if v := h.Get(headerDLQRetried); v != "" {
			part.handled[r.Offset] = true
			if off, err := strconv.ParseInt(v, 10, 64); err == nil {
				part.handled[off] = true
			}
			return nil
		}
		dl := DeadLetter{Seq: uint64(r.Offset) + 1, Partition: r.Partition, Time: r.Timestamp, Subject: topic, rec: r}
		fillDeadLetter(&dl, nats.Header(h))
		all = append(all, dl)
		return nil
	})
	if err != nil {
		return nil, err
	}
	sort.SliceStable(all, func(i, j int) bool {
		a, b := all[i], all[j]
		return a.Partition < b.Partition || a.Partition == b.Partition && a.Seq < b.Seq
	})
	// One dead letter per event: a resend stores another copy (Kafka has
	// no Nats-Msg-Id). The oldest copy stands for the others, and an event
	// of which one copy was retried is retried.
	retried := map[string]bool{}
	for _, dl := range all {
		if k := deadLetterIdentity(dl); k != "" && d.parts[dl.Partition].handled[int64(dl.Seq)-1] {
			retried[k] = true
		}
	}
	first := map[string]int{}
	for _, dl := range all {
		part := d.parts[dl.Partition]
		off := int64(dl.Seq) - 1
		if part.handled[off] {
			continue
		}
		k := deadLetterIdentity(dl)
		switch i, seen := first[k]; {
		case k == "":
		case retried[k]:
			part.handled[off] = true
			continue
		case seen:
			d.pending[i].copies = append(d.pending[i].copies, kafkaRef{dl.Partition, off})
			continue
		default:
			first[k] = len(d.pending)
		}
		d.pending = append(d.pending, dl)
	}
	return d, nil
}

// kafkaRef is a record of the dead-letter topic.
type kafkaRef struct {
	partition int32
	offset    int64
}

// deadLetterIdentity is a relay dead letter's event: its source, table and
// id (DESIGN.md, "Evidence"); "" when it has no id, or is a consumer
// group's.
func deadLetterIdentity(dl DeadLetter) string {
	if dl.ID == "" || dl.Group != "" || dl.rec == nil {
		return ""
	}
	h := kafkasink.FromKafkaHeaders(dl.rec.Headers)
	return h.Get(relay.HeaderSource) + "\x00" + relay.IdentityKey(h.Get(relay.HeaderTable), dl.ID)
}

// commitHandled commits, per partition, the offset past the retried dead
// letters and markers that follow the committed one.
func (d *kafkaDLQ) commitHandled(ctx context.Context, adm *kadm.Client) error {
	offs := kadm.Offsets{}
	for p, part := range d.parts {
		next := part.committed
		for part.handled[next] {
			next++
		}
		if next > part.committed {
			offs.AddOffset(d.topic, p, next, -1)
		}
	}
	if len(offs) == 0 {
		return nil
	}
	resp, err := adm.CommitOffsets(ctx, kafkaGroupDLQ, offs)
	if err == nil {
		err = resp.Error()
	}
	if err != nil {
		return fmt.Errorf("commit the offsets of group %s on %s: %w", kafkaGroupDLQ, d.topic, err)
	}
	return nil
}

func dlqListKafka(ctx context.Context, cfg config.Config, limit int) ([]DeadLetter, uint64, error) {
	cl, _, err := kafkaClient(cfg)
	if err != nil {
		return nil, 0, err
	}
	defer cl.Close()
	d, err := readKafkaDLQ(ctx, cfg, kadm.NewClient(cl))
	if err != nil {
		return nil, 0, err
	}
	dls := d.pending
	if limit > 0 && len(dls) > limit {
		dls = dls[:limit]
	}
	return dls, uint64(len(d.pending)), nil
}

func dlqRetryKafka(ctx context.Context, cfg config.Config, opts DLQRetryOptions) (*DLQRetryResult, error) {
	// Markers go to the partition of the dead letter they name.
	cl, sc, err := kafkaClient(cfg, kgo.RecordPartitioner(kgo.ManualPartitioner()), kgo.RequiredAcks(kgo.AllISRAcks()))
	if err != nil {
		return nil, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	d, err := readKafkaDLQ(ctx, cfg, adm)
	if err != nil {
		return nil, err
	}
	name := d.topic
	dls := d.pending
	if !opts.All {
		dls = nil
		for _, seq := range opts.Seqs {
			var found []DeadLetter
			for _, dl := range d.pending {
				match := dl.Seq == seq
				for _, c := range dl.copies {
					match = match || uint64(c.offset)+1 == seq
				}
				if match {
					found = append(found, dl)
				}
			}
			switch len(found) {
			case 0:
				return nil, fmt.Errorf("no dead letter with seq %d waits in %s (walbox dlq list shows those that do; a retried one is not shown)", seq, name)
			case 1:
				dls = append(dls, found[0])
			default:
				return nil, fmt.Errorf("seq %d is in %d partitions of %s: retry with --all, or give %s one partition", seq, len(found), name, name)
			}
		}
	}
	if opts.afterRead != nil {
		opts.afterRead()
	}
	res := &DLQRetryResult{}
	if ok, err := retryConfirmed(opts, len(dls), name+" holds no dead letter to retry",
		fmt.Sprintf("Republish %d dead letter(s) to their original topics and mark them retried in %s?", len(dls), name)); !ok {
		return res, err
	}
	routes, err := kafkaRoutes(ctx, adm, cfg)
	if err != nil {
		return nil, err
	}
	sink, err := kafkasink.New(sc)
	if err != nil {
		return nil, err
	}
	defer sink.Close()
	bar := newProgress(nil, false, "", 0, nil)
	if len(dls) > 100 {
		bar = newProgress(opts.Out, opts.TTY, "dlq retry", int64(len(dls)), func() string {
			return fmt.Sprintf("retried %d, skipped %d", res.Retried, res.Skipped)
		})
	}
	defer bar.finish()
	rc := &kafkaRetry{cfg: cfg, cl: cl, sink: sink, d: d, routes: routes, res: res, out: opts.Out,
		routers: map[string]*relay.Router{}, stored: map[string]map[string]bool{}}
	err = func() error {
		for _, dl := range dls {
			if err := rc.retryOne(ctx, dl); err != nil {
				return err
			}
			bar.add(1)
		}
		return nil
	}()
	bar.finish()
	// Also after a failure: the markers written so far hide their dead
	// letters either way, the commit only saves reading them again.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), connectTimeout)
	defer cancel()
	if cerr := d.commitHandled(cctx, adm); cerr != nil {
		fmt.Fprintf(opts.Out, "note: %v (the retried dead letters stay hidden by their markers)\n", cerr)
	}
	return res, err
}

// kafkaRetry is one run of dlq retry on Kafka.
type kafkaRetry struct {
	cfg     config.Config
	cl      *kgo.Client
	sink    *kafkasink.Sink
	d       *kafkaDLQ
	routes  []relay.Route
	routers map[string]*relay.Router
	// stored: per topic and source, the identities (relay.IdentityKey)
	// read back from the topic's newest records.
	stored map[string]map[string]bool
	res    *DLQRetryResult
	out    io.Writer
}

// retryTailRecords is how many of a source's newest records of each
// partition of a topic dlq retry reads back before it republishes to the
// topic (at least; twice the relay's window where that is more).
const retryTailRecords = 1000

// storedIn reads back, once per topic and source, the identities the
// topic's newest records of source hold.
func (rc *kafkaRetry) storedIn(ctx context.Context, topic, source string) (map[string]bool, error) {
	k := topic + "\x00" + source
	if ids, ok := rc.stored[k]; ok {
		return ids, nil
	}
	ids := map[string]bool{}
	want := max(retryTailRecords, 2*rc.cfg.NATS.Window)
	err := rc.sink.ReadBack(ctx, topic, source, relay.ReadBackRange{Want: want, ScanMax: 10 * want}, func(ev relay.StoredEvent) bool {
		ids[relay.IdentityKey(ev.Table, ev.ID)] = true
		return true
	})
	if err != nil {
		return nil, fmt.Errorf("read back the newest records of %s: %w", topic, err)
	}
	rc.stored[k] = ids
	return ids, nil
}

// retryOne republishes one dead letter, unless its topic's newest records
// hold its event already, and marks it (and its copies) retried.
func (rc *kafkaRetry) retryOne(ctx context.Context, dl DeadLetter) error {
	name := rc.d.topic
	h := kafkasink.FromKafkaHeaders(dl.rec.Headers)
	src := h.Get(relay.HeaderSource)
	rt, ok := rc.routers[src]
	if !ok {
		rt, _ = kafkaRouter(rc.cfg, src, rc.routes)
		rc.routers[src] = rt
	}
	m, why := kafkaRetryMessage(dl, name, rt, rc.routes)
	if why != "" {
		rc.res.Skipped++
		fmt.Fprintf(rc.out, "seq %d %s: skipped: %s\n", dl.Seq, orDash(dl.OriginalSubject), why)
		return nil
	}
	// The same evidence as the relay's: the event's identity read back
	// from the topic (a retry that died before its marker, a replay, a
	// relay that stored it after all).
	ident := relay.IdentityKey(h.Get(relay.HeaderTable), dl.ID)
	ids, err := rc.storedIn(ctx, m.Subject, src)
	if err != nil {
		return fmt.Errorf("dead letter %d: %w (it stays in %s)", dl.Seq, err, name)
	}
	if ids[ident] {
		if err := rc.mark(ctx, dl, ""); err != nil {
			return fmt.Errorf("dead letter %d is stored in %s already but was not marked retried in %s: %w", dl.Seq, m.Subject, name, err)
		}
		rc.res.AlreadyStored++
		fmt.Fprintf(rc.out, "seq %d %s: %s already holds id %s; marked retried in %s\n", dl.Seq, dl.OriginalSubject, m.Subject, dl.ID, name)
		return nil
	}
	f, err := rc.sink.Publish(m)
	if err != nil {
		return fmt.Errorf("republish dead letter %d to %s: %w (it stays in %s)", dl.Seq, m.Subject, err, name)
	}
	pctx, cancel := context.WithTimeout(ctx, rc.cfg.Kafka.AckTimeout+connectTimeout)
	ack, err := relay.Await(pctx, f)
	cancel()
	if err != nil {
		return fmt.Errorf("republish dead letter %d to %s: %w (it stays in %s)", dl.Seq, m.Subject, err, name)
	}
	ids[ident] = true
	if err := rc.mark(ctx, dl, ack.Stream+"/"+strconv.FormatUint(ack.Sequence, 10)); err != nil {
		return fmt.Errorf("dead letter %d was republished (%s partition %d seq %d) but not marked retried in %s: %w; a retry reads %s back and does not store it again while it is among the newest %d records of its partition",
			dl.Seq, ack.Stream, ack.Partition, ack.Sequence, name, err, ack.Stream, max(retryTailRecords, 2*rc.cfg.NATS.Window))
	}
	rc.res.Retried++
	fmt.Fprintf(rc.out, "seq %d %s: republished to %s (partition %d, seq %d, id %s); marked retried in %s\n",
		dl.Seq, dl.OriginalSubject, ack.Stream, ack.Partition, ack.Sequence, dl.ID, name)
	return nil
}

// mark writes a marker for dl and for each of its copies, in the
// partition of the record it names; from is where the event was
// republished ("" when it was found stored).
func (rc *kafkaRetry) mark(ctx context.Context, dl DeadLetter, from string) error {
	refs := append([]kafkaRef{{dl.Partition, int64(dl.Seq) - 1}}, dl.copies...)
	for _, ref := range refs {
		marker := &kgo.Record{Topic: rc.d.topic, Partition: ref.partition, Headers: []kgo.RecordHeader{
			{Key: headerDLQRetried, Value: []byte(strconv.FormatInt(ref.offset, 10))},
			{Key: kafkasink.HeaderEventID, Value: []byte(dl.ID)},
		}}
		if from != "" {
			marker.Headers = append(marker.Headers, kgo.RecordHeader{Key: HeaderDLQRetriedFrom, Value: []byte(from)})
		}
		pctx, cancel := context.WithTimeout(ctx, rc.cfg.Kafka.AckTimeout+connectTimeout)
		mr, err := rc.cl.ProduceSync(pctx, marker).First()
		cancel()
		if err != nil {
			return fmt.Errorf("mark record %d/%d: %w", ref.partition, ref.offset, err)
		}
		part := rc.d.parts[ref.partition]
		part.handled[ref.offset], part.handled[mr.Offset] = true, true
	}
	return nil
}

// kafkaRetryMessage rebuilds a dead letter's event for its original topic,
// through the relay's router when the dead letter names the row's topic,
// or says why it cannot be retried.
func kafkaRetryMessage(dl DeadLetter, dlqTopic string, rt *relay.Router, routes []relay.Route) (*relay.Msg, string) {
	r := dl.rec
	h := kafkasink.FromKafkaHeaders(r.Headers)
	from := dlqTopic + "/" + strconv.FormatUint(dl.Seq, 10)
	switch {
	case dl.Group != "":
		return nil, "a consumer group's dead letter: walbox retries those on NATS only"
	case dl.OriginalSubject == "" || relay.ValidSubject(dl.OriginalSubject) != nil:
		return nil, fmt.Sprintf("the original topic %q is not a valid topic (fix the row's topic and replay it: walbox replay --id %s)", dl.OriginalSubject, orDash(dl.ID))
	case dl.ID == "":
		return nil, "no event id (the row's id was NULL or empty)"
	case h.Get(headerPayloadDropped) != "":
		return nil, fmt.Sprintf("its payload (%s bytes) was too large and was dropped; replay it from the outbox: walbox replay --id %s", h.Get(headerPayloadDropped), dl.ID)
	case !json.Valid(r.Value):
		return nil, "the payload is not valid JSON"
	}
	notDeclared := fmt.Sprintf("topic %s is not in kafka.topics, or does not exist on the brokers (add it to kafka.topics and restart walbox, which creates it)", dl.OriginalSubject)
	if topic := h.Get(relay.HeaderDLQOriginalTopic); topic != "" && rt != nil {
		ev := relay.EventFromHeaders(h, topic, dl.ID, r.Value)
		m, _, err := rt.Message(&ev)
		var pe *relay.PoisonError
		switch {
		case errors.As(err, &pe) && strings.Contains(pe.Reason, "no configured stream"):
			return nil, notDeclared
		case err != nil:
			return nil, fmt.Sprintf("the router refuses it: %v", err)
		}
		m.Header.Set(HeaderDLQRetriedFrom, from)
		return m, ""
	}
	declared := false
	for _, rt := range routes {
		declared = declared || rt.Stream == dl.OriginalSubject
	}
	if !declared {
		return nil, notDeclared
	}
	out := relay.Header{}
	for k, v := range h {
		if !strings.HasPrefix(k, "Walbox-Dlq-") && k != consumer.HeaderError && k != consumer.HeaderAttempts {
			out[k] = v
		}
	}
	out.Set(relay.HeaderMsgID, dl.ID)
	out.Set(HeaderDLQRetriedFrom, from)
	key := h.Get(relay.HeaderPartitionKey)
	if key == "" {
		key = h.Get(relay.HeaderAggregateID)
	}
	return &relay.Msg{Subject: dl.OriginalSubject, Key: key, Data: r.Value, Header: out}, ""
}

// DLQName is where dead letters go: the stream nats.dlq.stream, or with
// sink: kafka the topic kafka.dlq_topic.
func DLQName(cfg config.Config) string {
	if cfg.Sink == config.SinkKafka {
		return cfg.Kafka.DLQTopic
	}
	return cfg.NATS.DLQ.Stream
}

// kafkaDLQCount is how many dead letters wait in the dead-letter topic
// (for walbox status): read as dlq list reads them when the topic holds at
// most 10000 records past the offsets group walbox-dlq committed; past
// that, the count of those records, which includes dead letters retried
// (and their markers) behind the first one still waiting.
func kafkaDLQCount(ctx context.Context, cfg config.Config) (uint64, error) {
	cl, _, err := kafkaClient(cfg)
	if err != nil {
		return 0, err
	}
	defer cl.Close()
	adm := kadm.NewClient(cl)
	topic := cfg.Kafka.DLQTopic
	spans, exists, err := topicSpans(ctx, adm, topic, time.Time{})
	if err != nil {
		return 0, err
	}
	if !exists {
		return 0, fmt.Errorf("dead-letter topic %s does not exist (walbox run creates it)", topic)
	}
	committed, err := adm.FetchOffsets(ctx, kafkaGroupDLQ)
	if err != nil && !errors.Is(err, kerr.GroupIDNotFound) {
		return 0, fmt.Errorf("read the offsets group %s committed on %s: %w", kafkaGroupDLQ, topic, err)
	}
	var n uint64
	for p, s := range spans {
		if c, ok := committed.Lookup(topic, p); ok && c.Err == nil && c.At > s.from {
			s.from = min(c.At, s.to)
		}
		n += uint64(s.to - s.from)
	}
	if n == 0 || n > 10000 {
		return n, nil
	}
	d, err := readKafkaDLQ(ctx, cfg, adm)
	if err != nil {
		return 0, err
	}
	return uint64(len(d.pending)), nil
}
