package consumer

// WithAfterCommit sets the test hook that runs after the handler's
// transaction committed; returning true naks instead of acking, forcing a
// redelivery of an event already processed.
func WithAfterCommit(c Config, f func(Message) bool) Config {
	c.afterCommit = f
	return c
}
