package config

import (
	"regexp"
	"time"

	"github.com/walbox/walbox/relay/claim"
)

// ClaimCheck is the claim_check section: payloads larger than the broker
// takes in one message go to an object store, the message carries a
// reference (README, Large events).
type ClaimCheck struct {
	Enabled bool `yaml:"enabled" env:"ENABLED"`
	// Threshold: payloads larger than this many bytes are moved (0: the
	// server's max_payload less 64 KiB for headers).
	Threshold int `yaml:"threshold" env:"THRESHOLD"`
	// Bucket is the JetStream Object Store bucket ("": the first stream's
	// name + "_CLAIMS").
	Bucket string `yaml:"bucket" env:"BUCKET"`
	// Replicas of the bucket (0: the largest of the streams').
	Replicas int `yaml:"replicas" env:"REPLICAS"`
	// TTL is the bucket's max_age (0: the streams' largest max_age plus
	// one hour; unlimited when a stream keeps its messages forever).
	TTL time.Duration `yaml:"ttl" env:"TTL"`
	// MaxBytes bounds the bucket (0: unlimited); a payload larger than it
	// is dead-lettered.
	MaxBytes int64 `yaml:"max_bytes" env:"MAX_BYTES"`
	// UploadTimeout bounds one upload; a failed one is retried in order.
	UploadTimeout time.Duration `yaml:"upload_timeout" env:"UPLOAD_TIMEOUT"`
	// SweepInterval is how often objects whose message is gone are deleted.
	SweepInterval time.Duration `yaml:"sweep_interval" env:"SWEEP_INTERVAL"`
	// S3 is an S3-compatible bucket for the payloads: required with sink:
	// kafka, optional with nats (in place of the Object Store bucket).
	S3 S3 `yaml:"s3" envPrefix:"S3_"`
}

func defaultClaimCheck() ClaimCheck {
	return ClaimCheck{UploadTimeout: claim.DefaultUploadTimeout, SweepInterval: 5 * time.Minute, S3: S3{UseSSL: true}}
}

// ClaimS3 reports whether the claim check stores payloads in S3.
func (c *Config) ClaimS3() bool { return c.ClaimCheck.S3.Endpoint != "" }

var bucketNameRe = regexp.MustCompile(`^[a-zA-Z0-9_-]+$`)

// ttlMargin is what the default TTL adds to the streams' max_age: an
// object is written just before its message.
const ttlMargin = time.Hour

func (c *Config) validateClaimCheck(bad func(key, format string, args ...any)) {
	cc := c.ClaimCheck
	if !cc.Enabled {
		return
	}
	if c.Sink == SinkKafka && (cc.S3.Endpoint == "" || cc.S3.Bucket == "") {
		bad("claim_check.s3", "with sink: kafka the payloads go to an S3-compatible bucket: set claim_check.s3.endpoint and claim_check.s3.bucket (the bucket must exist)")
	}
	if cc.Threshold < 0 {
		bad("claim_check.threshold", "%d: must not be negative (0: the server's max_payload less 64 KiB)", cc.Threshold)
	}
	if cc.Bucket != "" && !bucketNameRe.MatchString(cc.Bucket) {
		bad("claim_check.bucket", "%q: use letters, digits, - and _", cc.Bucket)
	}
	if cc.Replicas < 0 || cc.Replicas > 5 {
		bad("claim_check.replicas", "%d: must be between 0 (the streams') and 5", cc.Replicas)
	}
	if cc.MaxBytes < 0 {
		bad("claim_check.max_bytes", "must not be negative (0: unlimited)")
	}
	if cc.UploadTimeout <= 0 {
		bad("claim_check.upload_timeout", "must be positive (the publisher waits for an upload, in order)")
	}
	if cc.SweepInterval <= 0 {
		bad("claim_check.sweep_interval", "must be positive")
	}
	forever, longest := c.streamsMaxAge()
	switch {
	case cc.TTL < 0:
		bad("claim_check.ttl", "must not be negative (0: derived from the streams' max_age)")
	case cc.TTL > 0 && forever:
		bad("claim_check.ttl", "%s: a stream in nats.streams has no max_age and keeps its messages forever; an object must live as long as its message: set ttl to 0", cc.TTL)
	case cc.TTL > 0 && cc.TTL < longest+c.NATS.AckTimeout:
		bad("claim_check.ttl", "%s: must be at least the streams' longest max_age (%s) plus nats.ack_timeout (%s), or an object could expire before its message; or 0 (derived)", cc.TTL, longest, c.NATS.AckTimeout)
	}
}

// streamsMaxAge reports whether a stream keeps messages forever, and the
// longest max_age of the others.
func (c *Config) streamsMaxAge() (forever bool, longest time.Duration) {
	for _, s := range c.NATS.Streams {
		if s.MaxAge == 0 {
			forever = true
		}
		longest = max(longest, s.MaxAge)
	}
	return forever, longest
}

// ClaimBucketSpec is the claim-check bucket the config declares, with its
// defaults derived from the streams.
func (c *Config) ClaimBucketSpec() claim.BucketSpec {
	cc := c.ClaimCheck
	spec := claim.BucketSpec{Name: cc.Bucket, Replicas: cc.Replicas, TTL: cc.TTL, MaxBytes: cc.MaxBytes, Storage: "file"}
	if spec.Name == "" && len(c.NATS.Streams) > 0 {
		spec.Name = c.NATS.Streams[0].Name + "_CLAIMS"
	}
	if spec.Replicas == 0 {
		for _, s := range c.NATS.Streams {
			spec.Replicas = max(spec.Replicas, s.Replicas)
		}
		spec.Replicas = max(spec.Replicas, 1)
	}
	if forever, longest := c.streamsMaxAge(); spec.TTL == 0 && !forever {
		spec.TTL = longest + ttlMargin
	}
	return spec
}
