// Package config loads walbox's configuration: one YAML file, overridden by
// WALBOX_* environment variables, overridden by flags (applied by the CLI).
// Every error names the key and what to change.
package config

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caarlos0/env/v11"
	"gopkg.in/yaml.v3"

	"github.com/walbox/walbox/cdc"
	"github.com/walbox/walbox/internal/fault"
	"github.com/walbox/walbox/internal/retry"
	"github.com/walbox/walbox/relay"
	"github.com/walbox/walbox/relay/jssink"
)

// Config is the whole configuration. Defaults are set by Default.
type Config struct {
	// Sink is where events go: nats (JetStream) or kafka.
	Sink     string   `yaml:"sink" env:"SINK"`
	Postgres Postgres `yaml:"postgres" envPrefix:"POSTGRES_"`
	Outbox   Outbox   `yaml:"outbox" envPrefix:"OUTBOX_"`
	// Outboxes lists several outbox tables, each with its own columns,
	// routing, envelope and sweeper settings, all on one slot and one
	// publication. outbox is the one-table shorthand.
	Outboxes []OutboxEntry `yaml:"outboxes"`
	NATS     NATS          `yaml:"nats" envPrefix:"NATS_"`
	Kafka    Kafka         `yaml:"kafka" envPrefix:"KAFKA_"`
	Retry    Retry         `yaml:"retry" envPrefix:"RETRY_"`
	Metrics  Metrics       `yaml:"metrics" envPrefix:"METRICS_"`
	Log      Log           `yaml:"log" envPrefix:"LOG_"`
	Sweeper  Sweeper       `yaml:"sweeper" envPrefix:"SWEEPER_"`
	Archive  Archive       `yaml:"archive" envPrefix:"ARCHIVE_"`
	Runtime  Runtime       `yaml:"runtime" envPrefix:"RUNTIME_"`
	OTel     OTel          `yaml:"otel" envPrefix:"OTEL_"`
	// ClaimCheck moves payloads too large for one message to an object store.
	ClaimCheck ClaimCheck `yaml:"claim_check" envPrefix:"CLAIM_CHECK_"`
	Console    Console    `yaml:"console" envPrefix:"CONSOLE_"`
}

// Console is the web console on the metrics listener (/ui).
type Console struct {
	// Enabled serves the console at /ui on metrics.listen.
	Enabled bool `yaml:"enabled" env:"ENABLED"`
	// Token, or the first line of TokenFile, is what an action that changes
	// something (retrying dead letters) must send in its X-Walbox-Token
	// header. Without one the console is read-only.
	Token     string `yaml:"token" env:"TOKEN"`
	TokenFile string `yaml:"token_file" env:"TOKEN_FILE"`
	// AllowedHosts are the host names (besides IP addresses and localhost)
	// the console answers under: a page of another site that rebinds its
	// name to this address cannot read it (DNS rebinding).
	AllowedHosts []string `yaml:"allowed_hosts" env:"ALLOWED_HOSTS"`
}

// Runtime is the process: `walbox run` applies it at start.
type Runtime struct {
	// GOMAXPROCS is how many CPUs run Go code at once; 0 leaves Go's default
	// (every CPU, or the container's limit). The default is 1: the relay is
	// a pipeline of goroutines that hand work to each other, and with more
	// than one P every hand-over is a cross-thread wake-up; on one P the
	// catch-up used 23% less CPU and the relay kept up with 8% more events
	// per second (make bench). A GOMAXPROCS environment variable wins.
	GOMAXPROCS int `yaml:"gomaxprocs" env:"GOMAXPROCS"`
}

// Postgres is the database side.
type Postgres struct {
	// URL of the database (postgres://user:pass@host:5432/db?sslmode=...).
	URL string `yaml:"url" env:"URL"`
	// Slot is the logical replication slot walbox owns.
	Slot string `yaml:"slot" env:"SLOT"`
	// Publication covers the outbox table.
	Publication string `yaml:"publication" env:"PUBLICATION"`
	// CreatePublication lets `walbox run` create a missing publication.
	CreatePublication bool `yaml:"create_publication" env:"CREATE_PUBLICATION"`
	// StatusInterval is the longest gap between status updates to the server.
	StatusInterval time.Duration `yaml:"status_interval" env:"STATUS_INTERVAL"`
	// OnSlotLost is what to do when the slot was dropped or invalidated:
	// recreate it and republish unprocessed rows, or fail.
	OnSlotLost string `yaml:"on_slot_lost" env:"ON_SLOT_LOST"`
	// HeartbeatInterval: when the slot has not advanced for this long, emit a
	// logical message so an idle outbox in a busy cluster holds no WAL (0: off).
	HeartbeatInterval time.Duration `yaml:"heartbeat_interval" env:"HEARTBEAT_INTERVAL"`
	// PasswordFile holds the PostgreSQL password (one line), so it need not
	// be in the URL, the environment or the process list. PGPASSWORD and
	// PGPASSFILE (~/.pgpass) work too, as for every libpq client.
	PasswordFile string `yaml:"password_file" env:"PASSWORD_FILE"`
	// FailoverSlot makes walbox create its slot with failover = true
	// (PostgreSQL 17+), so standbys with sync_replication_slots keep a copy
	// and walbox continues from it after a promotion, without a snapshot.
	FailoverSlot bool `yaml:"failover_slot" env:"FAILOVER_SLOT"`
	// Origin filters by where a change was made (PostgreSQL 16+): none
	// publishes only rows written on this server, not rows a logical
	// replication subscription applied here; any publishes both.
	Origin string `yaml:"origin" env:"ORIGIN"`
}

// Outbox describes the outbox table.
type Outbox struct {
	Table string `yaml:"table" env:"TABLE"`
	// Columns maps roles (id, topic, payload, stream, event_type,
	// aggregate_type, aggregate_id, partition_key, headers, created_at) to
	// column names. Unlisted roles keep their default name.
	Columns map[string]string `yaml:"columns" env:"COLUMNS"`
	// Layout presets the columns and the events' shape: walbox (the
	// default) or debezium (Debezium's outbox table and router defaults).
	Layout string `yaml:"layout" env:"LAYOUT"`
}

// OutboxEntry is one table of outboxes: outbox's keys, and this table's
// own routing, envelope and sweeper settings.
type OutboxEntry struct {
	Outbox `yaml:",inline"`
	// Default marks the table walbox.emit and walbox.emit_message write to
	// when they name none (else the first).
	Default bool `yaml:"default"`
	// This table's nats.routes, nats.subject_template (kafka.topic_template)
	// and nats.envelope; unset: those of the nats (kafka) section.
	Routes          []RouteRule   `yaml:"routes"`
	SubjectTemplate string        `yaml:"subject_template"`
	Envelope        string        `yaml:"envelope"`
	Sweeper         *TableSweeper `yaml:"sweeper"`
}

// NATS is the JetStream side.
type NATS struct {
	URL           string        `yaml:"url" env:"URL"`
	SubjectPrefix string        `yaml:"subject_prefix" env:"SUBJECT_PREFIX"`
	AckTimeout    time.Duration `yaml:"ack_timeout" env:"ACK_TIMEOUT"`
	Window        int           `yaml:"window" env:"WINDOW"`
	// WindowBytes bounds the bytes of events walbox holds in memory: a
	// quarter for the publish window, an eighth for each decoded batch
	// (up to six of them wait for the window or are being decoded).
	WindowBytes int64 `yaml:"window_bytes" env:"WINDOW_BYTES"`
	// StrictOrder puts Nats-Expected-Last-Sequence on every publish, so a
	// stream rejects a message whose predecessor was lost (a leader change
	// in a cluster) and walbox resends in order. Turn it off when several
	// writers share a stream.
	StrictOrder bool `yaml:"strict_order" env:"STRICT_ORDER"`
	// FastBatch publishes a busy stream's messages in flow-controlled
	// batches (nats-server 2.14+, allow_batched on the stream, which walbox
	// sets on the streams it manages): one flow ack per up to 256 messages
	// instead of one ack each. Needs strict_order; per message otherwise.
	FastBatch bool `yaml:"fast_batch" env:"FAST_BATCH"`
	// FastBatchAfter: per-message publishes to a stream in flight before
	// its next event opens a batch. A relay keeping up with a live rate has
	// a few in flight and publishes per message (lowest latency); a
	// catch-up fills the window and batches. 0 batches every event.
	FastBatchAfter int `yaml:"fast_batch_after" env:"FAST_BATCH_AFTER"`
	// AtomicTransactions publishes each transaction's events to a stream
	// as one atomic batch (nats-server 2.12.1+, allow_atomic on the stream,
	// which walbox sets on the streams it manages): a consumer never sees
	// part of a transaction. Consecutive transactions may share a batch; a
	// transaction is split only where it alone passes the server's batch
	// limit or the relay's window. Per message where the server or the
	// stream says no.
	AtomicTransactions bool     `yaml:"atomic_transactions" env:"ATOMIC_TRANSACTIONS"`
	Streams            []Stream `yaml:"streams"`
	// Routes assert the stream of topics by prefix: an event whose topic
	// starts with TopicPrefix must land in Stream, else it is dead-lettered.
	Routes []RouteRule `yaml:"routes"`
	// SubjectTemplate builds the subject (before subject_prefix) from
	// {topic}, {partition}, {bucket}, {event_type}, {aggregate_type}.
	SubjectTemplate string `yaml:"subject_template" env:"SUBJECT_TEMPLATE"`
	// PartitionBuckets is the number of {bucket} values.
	PartitionBuckets int `yaml:"partition_buckets" env:"PARTITION_BUCKETS"`
	// Envelope: raw, cloudevents, cloudevents-structured or envelope.
	Envelope string `yaml:"envelope" env:"ENVELOPE"`
	// CloudEventsSource is ce-source; "" means walbox/<database>/<slot>.
	CloudEventsSource string `yaml:"cloudevents_source" env:"CLOUDEVENTS_SOURCE"`
	DLQ               DLQ    `yaml:"dlq" envPrefix:"DLQ_"`
	// TLS and authentication (nats_auth.go). Secrets never reach logs.
	TLS         NATSTLS `yaml:"tls" envPrefix:"TLS_"`
	Credentials string  `yaml:"credentials" env:"CREDENTIALS"`
	NKey        string  `yaml:"nkey" env:"NKEY"`
	User        string  `yaml:"user" env:"USER"`
	Password    string  `yaml:"password" env:"PASSWORD"`
	Token       string  `yaml:"token" env:"TOKEN"`
}

// RouteRule routes topics with a prefix to one stream (nats.routes).
type RouteRule struct {
	TopicPrefix string `yaml:"topic_prefix"`
	Stream      string `yaml:"stream"`
}

// Stream is one JetStream stream.
type Stream struct {
	Name            string        `yaml:"name"`
	Subjects        []string      `yaml:"subjects"`
	Storage         string        `yaml:"storage"`
	Replicas        int           `yaml:"replicas"`
	DuplicateWindow time.Duration `yaml:"duplicate_window"`
	MaxAge          time.Duration `yaml:"max_age"`
	// Manage: create or update the stream at start (true), or only check it
	// exists where the platform team owns streams (false).
	Manage *bool `yaml:"manage"`
}

// DLQ is where undeliverable events go.
type DLQ struct {
	Stream        string `yaml:"stream" env:"STREAM"`
	SubjectPrefix string `yaml:"subject_prefix" env:"SUBJECT_PREFIX"`
	// Replicas of the dead-letter stream; 0: as many as the most
	// replicated configured stream, so losing one node never stops
	// dead-lettering where it would not stop publishing.
	Replicas int `yaml:"replicas" env:"REPLICAS"`
}

// Retry is the back-off after a transient failure.
type Retry struct {
	Initial time.Duration `yaml:"initial" env:"INITIAL"`
	Max     time.Duration `yaml:"max" env:"MAX"`
}

// Metrics is the HTTP endpoint for /metrics, /healthz, /readyz and /leader.
type Metrics struct {
	Listen string `yaml:"listen" env:"LISTEN"`
	// LivenessTimeout: /healthz fails once the main loop (the publisher
	// loop while leading, the leader-lock wait while standing by) has not
	// turned for this long. Every blocking call in those loops ends by a
	// timeout of its own well before it.
	LivenessTimeout time.Duration `yaml:"liveness_timeout" env:"LIVENESS_TIMEOUT"`
	// StuckAfter: /readyz fails while events wait in the publish window and
	// none has left it for this long, the oldest committed at least this
	// long ago.
	StuckAfter time.Duration `yaml:"stuck_after" env:"STUCK_AFTER"`
}

// Log configures logging.
type Log struct {
	Level  string `yaml:"level" env:"LEVEL"`
	Format string `yaml:"format" env:"FORMAT"` // auto, json, console
}

// Sweeper marks rows processed after their ack and keeps partitions ahead.
type Sweeper struct {
	// MarkProcessed: set processed/processed_at after the JetStream ack and
	// error/attempts for dead letters. false: walbox never updates rows.
	MarkProcessed bool `yaml:"mark_processed" env:"MARK_PROCESSED"`
	// BatchSize is the most rows one UPDATE marks.
	BatchSize int `yaml:"batch_size" env:"BATCH_SIZE"`
	// Interval: how long a partial batch waits before it is written.
	Interval time.Duration `yaml:"interval" env:"INTERVAL"`
	// PartitionStep is day or month; PartitionsAhead, in days.
	PartitionStep   string `yaml:"partition_step" env:"PARTITION_STEP"`
	PartitionsAhead int    `yaml:"partitions_ahead" env:"PARTITIONS_AHEAD"`
	// Maintain: keep partitions ahead and archive (needs table ownership).
	// false leaves both to the DBA; rows are still marked.
	Maintain bool `yaml:"maintain" env:"MAINTAIN"`
	// YieldAfter: while the relay reads events this long or longer after
	// their commit (it is catching up on a backlog), the sweeper writes no
	// marks; those beyond its queue are read back from the stream once the
	// relay has caught up. 0: never yield.
	YieldAfter time.Duration `yaml:"yield_after" env:"YIELD_AFTER"`
	// LockTimeout: the longest any maintenance statement waits for a lock.
	// A step that cannot have its lock in time is postponed (retried within
	// 15 s) instead of queueing producers behind its request.
	LockTimeout time.Duration `yaml:"lock_timeout" env:"LOCK_TIMEOUT"`
}

// Archive moves old processed rows out of the outbox, to cold storage, and
// deletes them after the retention age.
type Archive struct {
	// After: partitions (rows, when unpartitioned) older than this whose rows
	// are all processed move to walbox.<table>_archive. 0 turns archival off.
	After time.Duration `yaml:"after" env:"AFTER"`
	// ExportAfter: archived partitions older than this are exported to Dir
	// or S3 and dropped. 0 turns export off.
	ExportAfter time.Duration `yaml:"export_after" env:"EXPORT_AFTER"`
	// DeleteAfter: exports whose newest row is older than this are deleted.
	// 0 keeps them forever.
	DeleteAfter time.Duration `yaml:"delete_after" env:"DELETE_AFTER"`
	// Dir is a local directory for exports.
	Dir string `yaml:"dir" env:"DIR"`
	// S3 is an S3-compatible bucket for exports.
	S3 S3 `yaml:"s3" envPrefix:"S3_"`
}

// S3 locates an S3-compatible bucket.
type S3 struct {
	Endpoint  string `yaml:"endpoint" env:"ENDPOINT"` // host[:port], no scheme
	Bucket    string `yaml:"bucket" env:"BUCKET"`
	Prefix    string `yaml:"prefix" env:"PREFIX"`
	AccessKey string `yaml:"access_key" env:"ACCESS_KEY"`
	SecretKey string `yaml:"secret_key" env:"SECRET_KEY"`
	UseSSL    bool   `yaml:"use_ssl" env:"USE_SSL"`
}

// Default returns the configuration with every default filled in.
func Default() Config {
	return Config{
		Sink:  SinkNATS,
		Kafka: defaultKafka(),
		Postgres: Postgres{Slot: "walbox", Publication: "walbox_outbox", CreatePublication: true, StatusInterval: cdc.DefaultStatusInterval,
			OnSlotLost: "recreate", HeartbeatInterval: 30 * time.Second, Origin: "any"},
		Outbox: Outbox{Table: "public.outbox_events", Layout: LayoutWalbox},
		NATS: NATS{URL: "nats://127.0.0.1:4222", AckTimeout: 10 * time.Second, Window: 1024, WindowBytes: 64 << 20, StrictOrder: true, FastBatch: true, FastBatchAfter: 32,
			SubjectTemplate: relay.DefaultSubjectTemplate, PartitionBuckets: relay.DefaultPartitionBuckets, Envelope: relay.EnvelopeRaw,
			DLQ: DLQ{Stream: "WALBOX_DLQ", SubjectPrefix: "walbox.dlq."}},
		Retry:      Retry{Initial: retry.DefaultInitial, Max: retry.DefaultMax},
		Metrics:    Metrics{Listen: "127.0.0.1:9187", LivenessTimeout: 5 * time.Minute, StuckAfter: 2 * time.Minute},
		Log:        Log{Level: "info", Format: "auto"},
		Sweeper:    Sweeper{MarkProcessed: true, BatchSize: 1000, Interval: 200 * time.Millisecond, PartitionStep: "day", PartitionsAhead: 7, Maintain: true, YieldAfter: time.Second, LockTimeout: 100 * time.Millisecond},
		Archive:    Archive{After: 90 * 24 * time.Hour, DeleteAfter: 3 * 365 * 24 * time.Hour, S3: S3{UseSSL: true}},
		Runtime:    Runtime{GOMAXPROCS: 1},
		OTel:       OTel{ServiceName: "walbox"},
		ClaimCheck: defaultClaimCheck(),
		Console:    Console{Enabled: true, AllowedHosts: []string{}},
	}
}

// ApplyPasswordFile puts the password of postgres.password_file into
// postgres.url. Call it after every override of the URL.
func (c *Config) ApplyPasswordFile() error {
	if c.Postgres.PasswordFile == "" {
		return nil
	}
	b, err := os.ReadFile(c.Postgres.PasswordFile)
	if err != nil {
		return &Error{Key: "postgres.password_file", Msg: fmt.Sprintf("cannot read it: %v", err)}
	}
	pw := strings.TrimRight(string(b), "\r\n")
	if pw == "" {
		return &Error{Key: "postgres.password_file", Msg: "the file is empty"}
	}
	if strings.HasPrefix(c.Postgres.URL, "postgres://") || strings.HasPrefix(c.Postgres.URL, "postgresql://") {
		u, err := url.Parse(c.Postgres.URL)
		if err != nil {
			return &Error{Key: "postgres.url", Msg: "cannot parse it (the password is not shown)"}
		}
		user := ""
		if u.User != nil {
			user = u.User.Username()
		}
		u.User = url.UserPassword(user, pw)
		c.Postgres.URL = u.String()
		return nil
	}
	// key=value form
	c.Postgres.URL += " password='" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(pw) + "'"
	return nil
}

// Load reads path (may be empty: defaults only), then applies WALBOX_*
// variables from environ (os.Environ() format). The caller applies flags and
// then calls Validate.
func Load(path string, environ []string) (Config, error) {
	cfg := Default()
	if path != "" {
		data, err := os.ReadFile(path)
		if err != nil {
			return cfg, fmt.Errorf("read config file: %w", err)
		}
		if err := decodeYAML(data, &cfg); err != nil {
			return cfg, fmt.Errorf("config file %s: %w", path, err)
		}
	}
	if err := ApplyEnv(&cfg, environ); err != nil {
		return cfg, err
	}
	return cfg, nil
}

var notFoundRe = regexp.MustCompile(`field (\S+) not found in type config\.(\w+)`)

// typeErrRe is yaml.v3's "line 12: cannot unmarshal !!str `ten` into int".
var typeErrRe = regexp.MustCompile("line (\\d+): cannot unmarshal !!\\w+ (`[^`]*`|[^ ]+) into ([\\w.\\[\\]]+)")

// formOf says what a Go type wants, for the YAML type errors.
var formOf = map[string]string{
	"int": "a whole number like 1024", "int32": "a whole number like 1024", "int64": "a whole number like 1024",
	"uint64": "a whole number like 1024", "bool": "true or false", "time.Duration": "a duration like 10s, 500ms or 2m",
	"string": "a string", "[]string": "a list of strings, e.g. [\"orders.>\"]", "map[string]string": "a mapping of names",
	"float64": "a number",
}

// keyAtLine is the dotted key whose value is on line of the YAML document
// ("nats.ack_timeout"), or "".
func keyAtLine(data []byte, line int) string {
	var root yaml.Node
	if yaml.Unmarshal(data, &root) != nil {
		return ""
	}
	var find func(n *yaml.Node, prefix string) string
	find = func(n *yaml.Node, prefix string) string {
		switch n.Kind {
		case yaml.DocumentNode:
			for _, c := range n.Content {
				if k := find(c, prefix); k != "" {
					return k
				}
			}
		case yaml.SequenceNode:
			for _, c := range n.Content {
				if k := find(c, prefix+"[]"); k != "" {
					return k
				}
			}
		case yaml.MappingNode:
			for i := 0; i+1 < len(n.Content); i += 2 {
				key := n.Content[i].Value
				if prefix != "" {
					key = prefix + "." + key
				}
				v := n.Content[i+1]
				if v.Line == line && v.Kind == yaml.ScalarNode {
					return key
				}
				if k := find(v, key); k != "" {
					return k
				}
			}
		}
		return ""
	}
	return find(&root, "")
}

var sectionOf = map[string]string{
	"Config": "", "Postgres": "postgres.", "Outbox": "outbox.", "TableSweeper": "outboxes[].sweeper.", "OutboxEntry": "outboxes[].", "NATS": "nats.", "Stream": "nats.streams[].", "RouteRule": "nats.routes[].",
	"DLQ": "nats.dlq.", "NATSTLS": "nats.tls.", "Retry": "retry.", "Metrics": "metrics.", "Log": "log.",
	"Sweeper": "sweeper.", "Archive": "archive.", "S3": "archive.s3.", "ClaimCheck": "claim_check.",
}

func decodeYAML(data []byte, cfg *Config) error {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil {
		if errors.Is(err, io.EOF) { // an empty file: defaults only
			return nil
		}
		msg := notFoundRe.ReplaceAllStringFunc(err.Error(), func(s string) string {
			m := notFoundRe.FindStringSubmatch(s)
			return fmt.Sprintf("unknown key %s%s (check the spelling against testdata/walbox.yaml)", sectionOf[m[2]], m[1])
		})
		msg = typeErrRe.ReplaceAllStringFunc(msg, func(s string) string {
			m := typeErrRe.FindStringSubmatch(s)
			line, _ := strconv.Atoi(m[1])
			key := keyAtLine(data, line)
			if key == "" {
				key = "line " + m[1]
			}
			return fmt.Sprintf("%s: %s is not %s", key, m[2], formOf[m[3]])
		})
		return errors.New(strings.TrimPrefix(msg, "yaml: "))
	}
	return nil
}

// ApplyEnv overrides cfg from WALBOX_* variables in environ.
func ApplyEnv(cfg *Config, environ []string) error {
	m := map[string]string{}
	for _, kv := range environ {
		k, v, ok := strings.Cut(kv, "=")
		if ok && strings.HasPrefix(k, "WALBOX_") {
			m[k] = v
		}
	}
	if err := checkEnv(m); err != nil {
		return err
	}
	if err := env.ParseWithOptions(cfg, env.Options{Prefix: "WALBOX_", Environment: m}); err != nil {
		return fmt.Errorf("environment: %w", err)
	}
	return nil
}

// Validate checks every key and returns an error naming the first bad one.
func (c *Config) Validate() error { return c.validate(true) }

// ValidatePostgres checks every key but the nats.* ones: for the commands
// that use only PostgreSQL (slot, status, archive, migrate).
func (c *Config) ValidatePostgres() error { return c.validate(false) }

func (c *Config) validate(withNATS bool) error {
	var errs []string
	kafka := c.Sink == SinkKafka
	bad := func(key, format string, args ...any) {
		if (!withNATS || kafka) && strings.HasPrefix(key, "nats.") && !sharedNATSKey(key) {
			return
		}
		if !withNATS && strings.HasPrefix(key, "kafka.") {
			return
		}
		errs = append(errs, fmt.Sprintf("%s: %s", key, fmt.Sprintf(format, args...)))
	}
	if c.Postgres.URL == "" {
		bad("postgres.url", "is required (or set WALBOX_POSTGRES_URL, or pass --postgres-url)")
	}
	if !validIdent(c.Postgres.Slot) {
		bad("postgres.slot", "%q is not a valid slot name: use lower-case letters, digits and _ (at most 63)", c.Postgres.Slot)
	}
	if c.Postgres.Publication == "" {
		bad("postgres.publication", "is required")
	}
	if c.Postgres.StatusInterval <= 0 || c.Postgres.StatusInterval > 30*time.Second {
		bad("postgres.status_interval", "%s: must be between 1ms and 30s (the server drops replication after wal_sender_timeout, 60s by default)", c.Postgres.StatusInterval)
	}
	if c.Postgres.OnSlotLost != "recreate" && c.Postgres.OnSlotLost != "fail" {
		bad("postgres.on_slot_lost", "%q: use recreate (republish unprocessed rows) or fail", c.Postgres.OnSlotLost)
	}
	if c.Postgres.HeartbeatInterval < 0 {
		bad("postgres.heartbeat_interval", "must not be negative (0 turns the heartbeat off)")
	}
	if c.NATS.URL == "" {
		bad("nats.url", "is required (or set WALBOX_NATS_URL, or pass --nats-url)")
	}
	if c.NATS.Window < 1 || c.NATS.Window > 65536 {
		bad("nats.window", "%d: must be between 1 and 65536", c.NATS.Window)
	}
	if c.NATS.FastBatchAfter < 0 {
		bad("nats.fast_batch_after", "%d: must be 0 (batch every event) or more", c.NATS.FastBatchAfter)
	}
	if c.Postgres.Origin != "" && c.Postgres.Origin != "any" && c.Postgres.Origin != "none" {
		bad("postgres.origin", "%q: use any or none", c.Postgres.Origin)
	}
	if c.NATS.WindowBytes < 1<<20 {
		bad("nats.window_bytes", "%d: must be at least 1048576 (1 MiB)", c.NATS.WindowBytes)
	}
	if c.NATS.AckTimeout <= 0 {
		bad("nats.ack_timeout", "must be positive")
	}
	if c.NATS.SubjectPrefix != "" && !strings.HasSuffix(c.NATS.SubjectPrefix, ".") {
		bad("nats.subject_prefix", "%q must end with '.'", c.NATS.SubjectPrefix)
	}
	if len(c.NATS.Streams) == 0 {
		bad("nats.streams", "declare at least one stream with its subjects, e.g. {name: ORDERS, subjects: [\"orders.>\"]}")
	}
	seen := map[string]bool{}
	type subj struct{ stream, subject string }
	var all []subj
	for i, s := range c.NATS.Streams {
		key := fmt.Sprintf("nats.streams[%d]", i)
		if s.Name == "" || strings.ContainsAny(s.Name, " .*>\t") {
			bad(key+".name", "%q is not a valid stream name", s.Name)
		}
		if seen[s.Name] {
			bad(key+".name", "stream %q is declared twice", s.Name)
		}
		if s.Name == c.NATS.DLQ.Stream {
			bad(key+".name", "%q is the dead-letter stream (nats.dlq.stream): give one of them another name", s.Name)
		}
		seen[s.Name] = true
		if len(s.Subjects) == 0 {
			bad(key+".subjects", "stream %q needs at least one subject", s.Name)
		}
		for _, sub := range s.Subjects {
			if sub == "" || strings.ContainsAny(sub, " \t") {
				bad(key+".subjects", "%q is not a valid subject", sub)
			}
			if dlq := c.NATS.DLQ.SubjectPrefix + ">"; strings.HasSuffix(c.NATS.DLQ.SubjectPrefix, ".") && subjectsOverlap(sub, dlq) {
				bad(key+".subjects", "%q overlaps the dead-letter subjects %q (nats.dlq.subject_prefix)", sub, dlq)
			}
			all = append(all, subj{s.Name, sub})
		}
		switch s.Storage {
		case "", "file", "memory":
		default:
			bad(key+".storage", "%q: use file or memory", s.Storage)
		}
		if s.Replicas < 0 || s.Replicas > 5 {
			bad(key+".replicas", "%d: must be between 1 and 5", s.Replicas)
		}
		if s.DuplicateWindow < 0 {
			bad(key+".duplicate_window", "must not be negative")
		}
	}
	for i := range all {
		for j := i + 1; j < len(all); j++ {
			if all[i].stream != all[j].stream && subjectsOverlap(all[i].subject, all[j].subject) {
				bad("nats.streams", "subjects %q (stream %s) and %q (stream %s) overlap; a subject must belong to one stream",
					all[i].subject, all[i].stream, all[j].subject, all[j].stream)
			}
		}
	}
	c.validateRouting(bad, seen)
	c.validateOutboxes(bad, seen)
	if c.NATS.DLQ.Stream == "" || !strings.HasSuffix(c.NATS.DLQ.SubjectPrefix, ".") {
		bad("nats.dlq", "stream must be set and subject_prefix must end with '.'")
	}
	if c.Retry.Initial <= 0 || c.Retry.Max < c.Retry.Initial {
		bad("retry", "initial must be positive and max at least initial")
	}
	if c.Metrics.LivenessTimeout < time.Second {
		bad("metrics.liveness_timeout", "%s: must be at least 1s (the main loop turns every second)", c.Metrics.LivenessTimeout)
	}
	if c.Metrics.StuckAfter < time.Second {
		bad("metrics.stuck_after", "%s: must be at least 1s", c.Metrics.StuckAfter)
	}
	switch c.Log.Format {
	case "auto", "json", "console":
	default:
		bad("log.format", "%q: use auto, json or console", c.Log.Format)
	}
	if c.Console.Token != "" && c.Console.TokenFile != "" {
		bad("console.token_file", "set console.token or console.token_file, not both")
	}
	if c.Runtime.GOMAXPROCS < 0 || c.Runtime.GOMAXPROCS > 1024 {
		bad("runtime.gomaxprocs", "%d: use 0 (Go's default: every CPU) or a count of CPUs, 1 to 1024", c.Runtime.GOMAXPROCS)
	}
	switch c.Log.Level {
	case "trace", "debug", "info", "warn", "error":
	default:
		bad("log.level", "%q: use debug, info, warn or error", c.Log.Level)
	}
	switch c.Sink {
	case SinkNATS:
	case SinkKafka:
		c.validateKafka(bad)
	default:
		bad("sink", "%q: use nats or kafka", c.Sink)
	}
	c.validateSweeper(bad)
	c.validateNATSAuth(bad)
	c.validateOTel(bad)
	c.validateClaimCheck(bad)
	if len(errs) > 0 {
		return fmt.Errorf("invalid configuration:\n  %s", strings.Join(errs, "\n  "))
	}
	return nil
}

// sharedNATSKey reports whether a nats.* key applies to the Kafka sink too:
// the publish window and the event's shape.
func sharedNATSKey(key string) bool {
	for _, k := range []string{"nats.window", "nats.window_bytes", "nats.partition_buckets", "nats.envelope", "nats.cloudevents_source"} {
		if key == k {
			return true
		}
	}
	return false
}

// validateRouting checks nats.routes, subject_template, partition_buckets,
// envelope. streams holds the declared stream names.
func (c *Config) validateRouting(bad func(key, format string, args ...any), streams map[string]bool) {
	seen := map[string]bool{}
	for i, r := range c.NATS.Routes {
		key := fmt.Sprintf("nats.routes[%d]", i)
		if r.TopicPrefix == "" {
			bad(key+".topic_prefix", "is required, e.g. \"agent.run.\"")
		} else if seen[r.TopicPrefix] {
			bad(key+".topic_prefix", "%q is listed twice", r.TopicPrefix)
		}
		seen[r.TopicPrefix] = true
		switch {
		case r.Stream == "":
			bad(key+".stream", "is required: the stream events with topic prefix %q must land in", r.TopicPrefix)
		case r.Stream == c.NATS.DLQ.Stream:
			bad(key+".stream", "%q is the dead-letter stream (nats.dlq.stream)", r.Stream)
		case !streams[r.Stream]:
			bad(key+".stream", "%q is not declared in nats.streams", r.Stream)
		}
	}
	if err := relay.ValidateSubjectTemplate(c.NATS.SubjectTemplate); err != nil {
		bad("nats.subject_template", "%v", err)
	}
	if c.NATS.PartitionBuckets < 1 || c.NATS.PartitionBuckets > 65536 {
		bad("nats.partition_buckets", "%d: must be between 1 and 65536", c.NATS.PartitionBuckets)
	}
	if !slices.Contains(relay.Envelopes, c.NATS.Envelope) {
		bad("nats.envelope", "%q: use %s", c.NATS.Envelope, strings.Join(relay.Envelopes, ", "))
	}
	if strings.ContainsAny(c.NATS.CloudEventsSource, "\r\n") {
		bad("nats.cloudevents_source", "must be one line")
	}
}

// OutboxTable is the default outbox table (outbox.table, or the one of
// outboxes marked default, else the first), parsed.
func (c *Config) OutboxTable() (cdc.TableName, error) {
	t, err := c.DefaultTable()
	return t.Name, err
}

// OutboxColumns is the default outbox table's column roles.
func (c *Config) OutboxColumns() (cdc.Columns, error) {
	t, err := c.DefaultTable()
	return t.Columns, err
}

// RouterOptions converts the routing and envelope config for the relay.
func (c *Config) RouterOptions() relay.RouterOptions {
	o := relay.RouterOptions{SubjectTemplate: c.NATS.SubjectTemplate, PartitionBuckets: c.NATS.PartitionBuckets,
		Envelope: c.NATS.Envelope, CloudEventsSource: c.NATS.CloudEventsSource}
	for _, r := range c.NATS.Routes {
		o.Rules = append(o.Rules, relay.RoutingRule{TopicPrefix: r.TopicPrefix, Stream: r.Stream})
	}
	return o
}

func validIdent(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
			return false
		}
	}
	return true
}

// subjectsOverlap reports whether some subject matches both filters.
func subjectsOverlap(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; i < len(at) && i < len(bt); i++ {
		if at[i] == ">" || bt[i] == ">" {
			return true
		}
		if at[i] != "*" && bt[i] != "*" && at[i] != bt[i] {
			return false
		}
	}
	return len(at) == len(bt)
}

// Streams converts the stream config for the relay.
func (c *Config) StreamSpecs() []jssink.StreamSpec {
	var out []jssink.StreamSpec
	dlqReplicas := c.NATS.DLQ.Replicas
	for _, s := range c.NATS.Streams {
		if c.NATS.DLQ.Replicas == 0 {
			dlqReplicas = max(dlqReplicas, s.Replicas)
		}
		manage := s.Manage == nil || *s.Manage
		dw := s.DuplicateWindow
		if dw == 0 {
			dw = 2 * time.Minute
		}
		noBatch := ""
		if !c.NATS.StrictOrder {
			noBatch = "nats.strict_order is false: a batch's acks prove each event stored only through its expected last sequence"
		}
		out = append(out, jssink.StreamSpec{Name: s.Name, Subjects: s.Subjects, Storage: s.Storage, Replicas: s.Replicas,
			DuplicateWindow: dw, MaxAge: s.MaxAge, Manage: manage, FastBatch: c.NATS.FastBatch, NoBatch: noBatch,
			Atomic: c.NATS.AtomicTransactions})
	}
	out = append(out, jssink.StreamSpec{Name: c.NATS.DLQ.Stream, Subjects: []string{c.NATS.DLQ.SubjectPrefix + ">"},
		Storage: "file", Replicas: max(dlqReplicas, 1), DuplicateWindow: 2 * time.Minute, Manage: true,
		FastBatch: c.NATS.FastBatch, NoBatch: "dead letters are published one at a time"})
	return out
}

// envVars lists every WALBOX_* variable the config reads, with its type.
func envVars(t reflect.Type, prefix string, out map[string]reflect.Type) {
	for i := range t.NumField() {
		f := t.Field(i)
		if p, ok := f.Tag.Lookup("envPrefix"); ok {
			envVars(f.Type, prefix+p, out)
			continue
		}
		if name, ok := f.Tag.Lookup("env"); ok {
			out[prefix+strings.Split(name, ",")[0]] = f.Type
		}
	}
}

// notConfig are WALBOX_* variables of the tools around walbox, not keys:
// the config file, the test and build scripts, docker compose's ports.
var notConfig = map[string]bool{"WALBOX_CONFIG": true, "WALBOX_PG_BINDIR": true, "WALBOX_PG_CACHE": true,
	"WALBOX_PG_PORT": true, "WALBOX_NATS_PORT": true, "WALBOX_CHAOS_DURATION": true, "WALBOX_LONG": true}

// checkEnv names a WALBOX_* variable that matches no key, or whose value
// does not parse, with the form it wants.
func checkEnv(m map[string]string) error {
	known := map[string]reflect.Type{}
	envVars(reflect.TypeOf(Config{}), "WALBOX_", known)
	var errs []string
	for _, k := range slices.Sorted(maps.Keys(m)) {
		v := m[k]
		t, ok := known[k]
		switch {
		case notConfig[k]:
		case !ok:
			errs = append(errs, fmt.Sprintf("%s matches no configuration key (see walbox.yaml's `# env` lines)", k))
		case t == reflect.TypeOf(time.Duration(0)):
			if _, err := time.ParseDuration(v); err != nil {
				errs = append(errs, fmt.Sprintf("%s=%s: want a duration like 10s, 500ms or 2m", k, v))
			}
		case t.Kind() == reflect.Bool:
			if _, err := strconv.ParseBool(v); err != nil {
				errs = append(errs, fmt.Sprintf("%s=%s: want true or false", k, v))
			}
		case t.Kind() == reflect.Int || t.Kind() == reflect.Int64 || t.Kind() == reflect.Int32:
			if _, err := strconv.ParseInt(v, 10, 64); err != nil {
				errs = append(errs, fmt.Sprintf("%s=%s: want a whole number like 1024", k, v))
			}
		}
	}
	if len(errs) > 0 {
		return errors.New("environment: " + strings.Join(errs, "; "))
	}
	return nil
}

// Error is a configuration error: it names the key and what to change
// (fault.ConfigError; Error is the same type).
type Error = fault.ConfigError
