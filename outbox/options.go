package outbox

import (
	"log/slog"
	"time"
)

// A Policy says what happens to the later messages of a key whose
// message is quarantined.
type Policy int

const (
	// Block holds the key's later messages back until an operator
	// retries or drops the quarantined one: the key's order is kept.
	Block Policy = iota
	// Skip publishes the key's later messages: the key keeps flowing,
	// without the quarantined message.
	Skip
)

// An Option configures [NewRelay].
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	id          string
	batch       int
	ttl         time.Duration
	poll        time.Duration
	pollOnly    bool
	maxAttempts int
	minBackoff  time.Duration
	maxBackoff  time.Duration
	policy      Policy
	keep        time.Duration
	pruneLimit  int
	pruneEvery  time.Duration
	logger      *slog.Logger
	published   func(partition int, msgs []Message)
	markHook    func(partition int, acked []Message) error
	maxParts    int
	noPipeline  bool // tests and benchmarks: mark every batch before the next publish
}

func defaultConfig() config {
	return config{
		batch:       500,
		ttl:         10 * time.Second,
		poll:        time.Second,
		maxAttempts: 10,
		minBackoff:  100 * time.Millisecond,
		maxBackoff:  time.Minute,
		pruneLimit:  1000,
		pruneEvery:  time.Minute,
		logger:      slog.New(slog.DiscardHandler),
	}
}

func (c *config) validate() error {
	switch {
	case c.batch < 1 || c.batch > 10000:
		return bad("batch size", "must be between 1 and 10000, got "+itoa(c.batch))
	case c.ttl < 30*time.Millisecond:
		return bad("lease TTL", "must be at least 30ms, got "+c.ttl.String())
	case c.poll <= 0:
		return bad("poll interval", "must be positive, got "+c.poll.String())
	case c.maxAttempts < 1:
		return bad("max attempts", "must be at least 1, got "+itoa(c.maxAttempts))
	case c.minBackoff <= 0 || c.maxBackoff < c.minBackoff:
		return bad("backoff", "needs 0 < min <= max, got "+c.minBackoff.String()+" and "+c.maxBackoff.String())
	case c.policy != Block && c.policy != Skip:
		return bad("poison policy", "is neither Block nor Skip")
	case c.keep < 0:
		return bad("retention", "must not be negative, got "+c.keep.String())
	case c.pruneLimit < 1 || c.pruneEvery <= 0:
		return bad("prune pacing", "needs a positive limit and interval")
	case len(c.id) > 200 || !printable(c.id):
		return bad("relay ID", "must be printable without spaces, at most 200 bytes")
	case c.maxParts < 0:
		return bad("max partitions", "must not be negative")
	}
	return nil
}

// WithRelayID names this relay in the lease table. Default: the host
// name, the process ID and a random suffix. Two live relays must never
// share an ID.
func WithRelayID(id string) Option { return optionFunc(func(c *config) { c.id = id }) }

// WithBatchSize sets how many rows a partition reads and publishes at a
// time (1 to 10000). Default 500.
func WithBatchSize(n int) Option { return optionFunc(func(c *config) { c.batch = n }) }

// WithLeaseTTL sets how long a partition lease lasts without renewal;
// the relay renews every third of it, and a crashed relay's partitions
// are taken over after it. Default 10s.
func WithLeaseTTL(d time.Duration) Option { return optionFunc(func(c *config) { c.ttl = d }) }

// WithPollInterval sets how often an idle partition reads the table when
// no notification woke it. Default 1s. While the relay listens to the
// source's notifications, an idle partition's polls back off from this
// interval, doubling, to at most the larger of it and the minimum retry
// backoff ([WithBackoff]): a new row's notification wakes it at once.
func WithPollInterval(d time.Duration) Option { return optionFunc(func(c *config) { c.poll = d }) }

// WithPollOnly ignores the source's notifications (LISTEN/NOTIFY does not
// pass a transaction-mode pooler) and only polls. Default: listen when
// the source is a [Notifier], and poll as well.
func WithPollOnly() Option { return optionFunc(func(c *config) { c.pollOnly = true }) }

// WithMaxAttempts quarantines a message after n failed attempts. Default
// 10. A permanent error ([IsPermanent]) quarantines at once.
func WithMaxAttempts(n int) Option { return optionFunc(func(c *config) { c.maxAttempts = n }) }

// WithBackoff sets the delay before a failed message's next attempt:
// min, doubling per attempt, at most max. Default 100ms to 1m. The key's
// later messages wait as long. While the relay listens to the source's
// notifications, min also bounds how far an idle partition's polls back
// off (see [WithPollInterval]): rows that notify nobody (a retry coming
// due, an operator's retry) are seen up to max(poll interval, min) late.
func WithBackoff(min, max time.Duration) Option {
	return optionFunc(func(c *config) { c.minBackoff, c.maxBackoff = min, max })
}

// WithPoisonPolicy sets what a quarantined message does to its key's
// later messages. Default [Block].
func WithPoisonPolicy(p Policy) Option { return optionFunc(func(c *config) { c.policy = p }) }

// WithRetention deletes published rows older than keep, in batches of
// limit every interval, when the source is a [Pruner] (a source that
// deletes rows when it marks them needs none). Default: no pruning.
func WithRetention(keep time.Duration, limit int, interval time.Duration) Option {
	return optionFunc(func(c *config) { c.keep, c.pruneLimit, c.pruneEvery = keep, limit, interval })
}

// WithLogger logs lease changes and failures. Default: discard.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) {
		if l != nil {
			c.logger = l
		}
	})
}

// WithPublishedHook calls f after each batch's acknowledged messages are
// marked, one call at a time per partition and in the order of the
// marks, from the partition's goroutine or its mark's (for metrics:
// commit-to-publish latency is time.Since(m.CreatedAt)). f must not
// retain msgs. Default none.
func WithPublishedHook(f func(partition int, msgs []Message)) Option {
	return optionFunc(func(c *config) { c.published = f })
}

// WithMarkHook calls f between the broker's acknowledgements and the
// mark, for fault-injection tests: when f returns an error the relay
// stops at once as if its process died there (no mark, no lease
// released) and Run returns that error. Default none.
func WithMarkHook(f func(partition int, acked []Message) error) Option {
	return optionFunc(func(c *config) { c.markHook = f })
}

// WithMaxPartitions caps how many partitions this relay holds at once
// (0: no cap beyond its fair share). Default 0.
func WithMaxPartitions(n int) Option { return optionFunc(func(c *config) { c.maxParts = n }) }
