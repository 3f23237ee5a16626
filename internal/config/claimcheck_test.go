package config

import (
	"testing"
	"time"
)

func TestClaimCheckValuesAreChecked(t *testing.T) {
	base := "postgres:\n  url: postgres://x\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>], max_age: 24h}\n"
	forever := "postgres:\n  url: postgres://x\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>]}\n"
	wantNamed(t, []namedCase{
		{"ttl shorter than max_age", base + "claim_check:\n  enabled: true\n  ttl: 1h\n", "claim_check.ttl", []string{"24h"}},
		{"ttl for a stream kept forever", forever + "claim_check:\n  enabled: true\n  ttl: 48h\n", "claim_check.ttl", []string{"forever"}},
		{"bucket with a dot", base + "claim_check:\n  enabled: true\n  bucket: a.b\n", "claim_check.bucket", nil},
		{"negative threshold", base + "claim_check:\n  enabled: true\n  threshold: -1\n", "claim_check.threshold", nil},
		{"upload timeout zero", base + "claim_check:\n  enabled: true\n  upload_timeout: 0s\n", "claim_check.upload_timeout", nil},
		{"kafka without s3", "sink: kafka\n" + base + "kafka:\n  brokers: [k:9092]\nclaim_check:\n  enabled: true\n", "claim_check.s3", []string{"kafka"}},
	})
}

func TestClaimBucketDefaultsComeFromTheStreams(t *testing.T) {
	cfg, err := load(t, "postgres:\n  url: postgres://x\nnats:\n  streams:\n    - {name: ORDERS, subjects: [orders.>], max_age: 24h, replicas: 3}\n    - {name: P, subjects: [p.>], max_age: 48h}\nclaim_check:\n  enabled: true\n")
	if err != nil {
		t.Fatal(err)
	}
	spec := cfg.ClaimBucketSpec()
	if spec.Name != "ORDERS_CLAIMS" || spec.Replicas != 3 || spec.TTL != 49*time.Hour {
		t.Fatalf("bucket %+v, want ORDERS_CLAIMS, 3 replicas, TTL 49h", spec)
	}
}
