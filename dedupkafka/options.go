package dedupkafka

import (
	"context"
	"log/slog"
	"strconv"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/twmb/franz-go/pkg/kgo"
)

func bad(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

type consumerConfig struct {
	concurrency int
	maxPoll     int
	batch       int
	maxHold     time.Duration
	commitWait  time.Duration
	drain       time.Duration
	replay      time.Duration
	logger      *slog.Logger
	onWarning   func(ctx context.Context, w Warning)
	kopts       []kgo.Opt
	// crash, for tests: asked before each commit; true makes Run stop as a
	// crashed process would (no commit, none on revocation either).
	crash func(offsets map[string]map[int32]kgo.EpochOffset) bool
}

func defaultConsumerConfig() consumerConfig {
	return consumerConfig{
		concurrency: 4,
		maxPoll:     500,
		batch:       1,
		maxHold:     30 * time.Second,
		commitWait:  10 * time.Second,
		drain:       10 * time.Second,
		logger:      slog.Default(),
	}
}

func (c *consumerConfig) validate() error {
	switch {
	case c.concurrency < 1:
		return bad("concurrency", "must be at least 1, got "+strconv.Itoa(c.concurrency))
	case c.maxPoll < 1:
		return bad("max poll records", "must be at least 1, got "+strconv.Itoa(c.maxPoll))
	case c.batch < 1 || c.batch > c.maxPoll:
		return bad("batch", "must be between 1 and the max poll records ("+strconv.Itoa(c.maxPoll)+"), got "+strconv.Itoa(c.batch))
	case c.maxHold < time.Millisecond:
		return bad("max hold", "must be at least 1ms, got "+c.maxHold.String())
	case c.commitWait <= 0:
		return bad("commit timeout", "must be positive, got "+c.commitWait.String())
	case c.drain < 0:
		return bad("drain timeout", "must not be negative, got "+c.drain.String())
	case c.replay < 0:
		return bad("replay horizon", "must not be negative, got "+c.replay.String())
	case c.logger == nil:
		return bad("logger", "is nil (pass slog.New(slog.DiscardHandler) to silence it)")
	}
	return nil
}

// A ConsumerOption configures a [Consumer].
type ConsumerOption interface{ applyConsumer(*consumerConfig) }

type consumerOption func(*consumerConfig)

func (f consumerOption) applyConsumer(c *consumerConfig) { f(c) }

// WithConcurrency sets how many partitions are processed at once (records
// of one partition always run one at a time, in offset order). Default 4.
func WithConcurrency(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.concurrency = n })
}

// WithMaxPollRecords bounds the records taken from the client per poll,
// over all partitions. A poll's records are processed, and their offsets
// committed, before the group may rebalance (kgo.BlockRebalanceOnPoll),
// so this bounds how long a rebalance waits for the consumer: keep
// records times handler time well under the rebalance timeout. Default
// 500.
func WithMaxPollRecords(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.maxPoll = n })
}

// WithBatch runs up to n records of a partition through
// [consumer.Processor.ProcessBatch] at once (two store round trips per
// batch instead of two per record). The records are still claimed, run and
// committed in offset order; but when one of them must be retried, the
// records after it in the same batch have already been applied, so a
// retry in batch mode can let a later record of the partition take effect
// before an earlier one (their redelivery is then a duplicate). Keep the
// default 1 where per-key order must hold through retries.
//
// A partition's batches go through a [consumer.Pipeline]: a batch's
// completion overlaps the claim and handlers of the next, and the records
// of a batch become final (committable) only once its completion
// returned. The pipeline carries over from one poll to the next: the
// completion of a partition's last batch of a poll overlaps the next poll
// and the claim of the partition's next batch, and its records are
// committed by the first commit after it returned (a rebalance or Close
// waits for it). After a batch whose handlers did not all succeed the
// next one waits for its decisions; only a completion that fails after
// clean handlers can find the next batch already run (its records then
// stay behind the held one and are duplicates when they run again).
func WithBatch(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.batch = n })
}

// WithMaxHold caps how long a Retry decision holds its partition before
// the record is processed again (Kafka has no per-record negative
// acknowledgement: the partition waits, the others go on). The delay is
// the processor's backoff, capped here. Default 30s.
func WithMaxHold(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.maxHold = d })
}

// WithCommitTimeout bounds each offset commit, which runs on a context
// detached from Run's so that a shutdown still commits what is final.
// Default 10s.
func WithCommitTimeout(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.commitWait = d })
}

// WithDrainTimeout bounds how long Close (or cancelling Run's context)
// lets the record being processed on each partition finish, its
// completion recorded, before the context it runs on is cancelled: a
// completion cut short would leave the record in progress, uncommitted,
// to be taken over after its lease and applied again. No new record
// starts once Close was called. Default 10s.
// A store call already sent when that context is cancelled ends by its
// store's own bound, not at once (redisstore waits for the reply up to
// the caller's deadline or its client's ConnWriteTimeout, 10s by
// default), so with a store that stopped answering Close can take that
// much longer than the drain timeout.
// A completion that the end of the drain cuts short is finished on a
// context bounded by the runner's finalize timeout (dedup.WithFinalizeTimeout,
// passed with consumer.WithRunnerOptions; default 10s), not left in
// progress, so Close can take up to that much longer too.
func WithDrainTimeout(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.drain = d })
}

// WithReplayHorizon states how far back you may replay the topics by hand
// (an offset reset, a re-consumption from a timestamp): Run warns when it
// is longer than the processor's retention. Default 0: only the topics'
// retention.ms and the group's offset retention are checked.
func WithReplayHorizon(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.replay = d })
}

// WithLogger sets the logger for start-up warnings, held partitions and
// failed commits; message IDs are logged, payloads never. Default
// slog.Default().
func WithLogger(l *slog.Logger) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.logger = l })
}

// WithWarning calls f for each [Warning] found when Run starts, for a
// metric or an alert. Default none (warnings are only logged).
func WithWarning(f func(ctx context.Context, w Warning)) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.onWarning = f })
}

// WithClientOptions adds franz-go options to the consumer's client (TLS,
// SASL, timeouts, a balancer, a rack). The adapter's own options
// (ConsumerGroup, ConsumeTopics, DisableAutoCommit, BlockRebalanceOnPoll,
// the partition callbacks, OnPartitionsCallbackBlocked) are applied after
// them and win. Default none.
func WithClientOptions(opts ...kgo.Opt) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.kopts = append(c.kopts, opts...) })
}
