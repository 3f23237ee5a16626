package outboxtest

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
)

// KafkaRecord is one record as kcat printed it.
type KafkaRecord struct {
	Topic     string   `json:"topic"`
	Partition int32    `json:"partition"`
	Offset    int64    `json:"offset"`
	Key       *string  `json:"key"`
	Payload   *string  `json:"payload"`
	Headers   []string `json:"headers"` // key, value, key, value...
}

// Header returns the first value of the record header key.
func (r KafkaRecord) Header(key string) string {
	for i := 0; i+1 < len(r.Headers); i += 2 {
		if r.Headers[i] == key {
			return r.Headers[i+1]
		}
	}
	return ""
}

// ReadKafkaWithKcat reads every record of the topics with kcat, a client
// that shares no code with walbox (librdkafka). It fails when kcat is not
// installed: the test set-up (scripts/ensure-kcat.sh) installs it.
func ReadKafkaWithKcat(ctx context.Context, brokers string, topics ...string) ([]KafkaRecord, error) {
	if _, err := exec.LookPath("kcat"); err != nil {
		return nil, fmt.Errorf("kcat not found (run scripts/ensure-kcat.sh, or apt-get install kcat): %w", err)
	}
	var out []KafkaRecord
	for _, topic := range topics {
		cmd := exec.CommandContext(ctx, "kcat", "-C", "-b", brokers, "-t", topic, "-o", "beginning", "-e", "-q", "-J")
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			return nil, fmt.Errorf("kcat -t %s: %w: %s", topic, err, strings.TrimSpace(stderr.String()))
		}
		sc := bufio.NewScanner(&stdout)
		sc.Buffer(make([]byte, 1<<20), 16<<20)
		for sc.Scan() {
			line := bytes.TrimSpace(sc.Bytes())
			if len(line) == 0 {
				continue
			}
			var r KafkaRecord
			if err := json.Unmarshal(line, &r); err != nil {
				return nil, fmt.Errorf("kcat output %q: %w", line, err)
			}
			out = append(out, r)
		}
		if err := sc.Err(); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// KafkaStreams groups the ids (the Walbox-Event-Id header) of records by
// topic and partition, in offset order: Check then judges per-partition
// order, the order Kafka keeps.
func KafkaStreams(recs []KafkaRecord) map[string][]string {
	out := map[string][]string{}
	for _, r := range recs {
		k := fmt.Sprintf("%s/%d", r.Topic, r.Partition)
		out[k] = append(out[k], r.Header("Walbox-Event-Id"))
	}
	return out
}

// KafkaSnapshot is the set of ids published from a snapshot (backfill after
// a slot was created): their commit LSN header is 0/0 (see CheckStreamed).
func KafkaSnapshot(recs []KafkaRecord) map[string]bool {
	out := map[string]bool{}
	for _, r := range recs {
		if r.Header("Walbox-Commit-Lsn") == "0/0" {
			out[r.Header("Walbox-Event-Id")] = true
		}
	}
	return out
}
