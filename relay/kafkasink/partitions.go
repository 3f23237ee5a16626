package kafkasink

import (
	"errors"
	"fmt"
	"sync"
)

// ErrPartitionCountChanged: a topic's partition count is not the one walbox
// recorded when it started. Kafka's key hashing depends on the count, so
// with another count a key's later events would go to another partition
// than its earlier ones, and a consumer could read them out of order. The
// relay waits on it (a configuration error) until walbox restarts.
var ErrPartitionCountChanged = errors.New("the topic's partition count changed since walbox started")

// partCounts is the partition count of each topic as walbox recorded it,
// when it ensured the topic at start or when it first produced to it, and
// the topics whose count has changed since.
type partCounts struct {
	onChange func(topic string, was, now int) // called once per topic, under mu

	mu       sync.Mutex
	recorded map[string]int
	changed  map[string]int // the count seen that differs
}

// see records n as topic's count when none is recorded, and reports
// whether n is the recorded count; once a topic's count changed it stays
// refused (until a restart records the new one).
func (c *partCounts) see(topic string, n int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.changed[topic]; ok {
		return false
	}
	was, ok := c.recorded[topic]
	if !ok {
		if c.recorded == nil {
			c.recorded = map[string]int{}
		}
		c.recorded[topic] = n
		return true
	}
	if n == was {
		return true
	}
	if c.changed == nil {
		c.changed = map[string]int{}
	}
	c.changed[topic] = n
	if c.onChange != nil {
		c.onChange(topic, was, n)
	}
	return false
}

// count is topic's recorded count.
func (c *partCounts) count(topic string) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	n, ok := c.recorded[topic]
	return n, ok
}

// err is ErrPartitionCountChanged for topic, with the fix, or nil when its
// count has not changed.
func (c *partCounts) err(topic string) error {
	c.mu.Lock()
	now, changed := c.changed[topic]
	was := c.recorded[topic]
	c.mu.Unlock()
	if !changed {
		return nil
	}
	return fmt.Errorf("%w: topic %s had %d partitions and has %d now, so keys would move to other partitions and their order break; "+
		"publishing to it waits. Fix: stop producers' inserts or let walbox wait, let the topic's consumers read everything up to now, then restart walbox, "+
		"which records the new count (README, Kafka: adding partitions)", ErrPartitionCountChanged, topic, was, now)
}
