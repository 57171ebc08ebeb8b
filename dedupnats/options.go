package dedupnats

import (
	"context"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/nats-io/nats.go/jetstream"
)

func bad(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

// ---- Consumer ----

type consumerConfig struct {
	batch       int
	concurrency int
	fetchWait   time.Duration
	ackWait     time.Duration // 0: derived from the processor's lease
	maxDeliver  int
	doubleAck   bool
	drain       time.Duration
	logger      *slog.Logger
	onWarning   func(ctx context.Context, w WindowWarning)
	adjust      []func(*jetstream.ConsumerConfig)

	// batchProcessing: a worker takes up to half a batch of queued
	// messages at once, through ProcessBatch.
	batchProcessing bool
}

func defaultConsumerConfig() consumerConfig {
	return consumerConfig{
		batch:       64,
		concurrency: 1,
		fetchWait:   5 * time.Second,
		maxDeliver:  -1,
		drain:       10 * time.Second,
		logger:      slog.Default(),
	}
}

func (c *consumerConfig) validate() error {
	switch {
	case c.batch < 1 || c.batch > 10000:
		return bad("batch", "must be between 1 and 10000, got "+strconv.Itoa(c.batch))
	case c.concurrency < 1:
		return bad("concurrency", "must be at least 1, got "+strconv.Itoa(c.concurrency))
	case c.batchProcessing && c.concurrency != 1:
		return bad("concurrency", "must be 1 with batch processing (a batch runs its handlers one at a time, in stream order), got "+strconv.Itoa(c.concurrency))
	case c.concurrency > c.batch:
		return bad("concurrency", "must not exceed the batch ("+strconv.Itoa(c.batch)+"): workers beyond it would never get a message")
	case c.fetchWait < 100*time.Millisecond:
		return bad("fetch wait", "must be at least 100ms, got "+c.fetchWait.String())
	case c.ackWait != 0 && c.ackWait < 100*time.Millisecond:
		return bad("ack wait", "must be at least 100ms (the InProgress heartbeat runs every third of it), got "+c.ackWait.String())
	case c.maxDeliver == 0 || c.maxDeliver < -1:
		return bad("max deliver", "must be -1 (unlimited) or positive, got "+strconv.Itoa(c.maxDeliver))
	case c.drain < 0:
		return bad("drain timeout", "must not be negative")
	case c.logger == nil:
		return bad("logger", "is nil (pass slog.New(slog.DiscardHandler) to silence it)")
	}
	return nil
}

// A ConsumerOption configures a [Consumer].
type ConsumerOption interface{ applyConsumer(*consumerConfig) }

type consumerOption func(*consumerConfig)

func (f consumerOption) applyConsumer(c *consumerConfig) { f(c) }

// WithBatch sets how many messages the consumer holds at most: it pulls
// when half of them are done, so the next batch arrives while the rest
// are processed. Keep it below the JetStream consumer's MaxAckPending
// (1000 unless changed) divided by the number of instances. Default 64.
func WithBatch(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.batch = n })
}

// WithConcurrency sets how many messages are processed at once. Default
// 1, which processes first deliveries in stream order. More trades that
// order for throughput: messages of one batch run in parallel and finish
// in any order (a version guard, package guard, keeps per-aggregate order
// where it matters). A retried message is redelivered after its delay
// either way, behind the messages that followed it.
func WithConcurrency(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.concurrency = n })
}

// WithBatchProcessing processes messages in batches instead of one at a
// time: a worker takes every message waiting for it, up to half the batch
// ([WithBatch]), runs them in stream order through a [consumer.Pipeline]
// (as [consumer.Processor.ProcessBatch]: the dedup store sees one batch
// claim and one batch complete instead of a claim and a complete per
// message, one round trip each on redisstore and memstore; and a batch's
// completion overlaps the claim of the next), then, once the batch's
// completion returned, settles each message (ack, nak with delay or term)
// exactly as it would one by one.
// Batches grow with the backlog: a message arriving on an idle stream
// is a batch of one and waits for nothing. While a batch runs, every
// message in it keeps getting InProgress, and its claims are extended.
//
// It has the semantics of concurrency 1: a batch's handlers run one at a
// time, in stream order, so [WithConcurrency] must stay 1 (the default).
// The price is latency: a message is acknowledged when its whole batch is
// done, and a slow handler delays the others of its batch. It is not the
// default for that reason, and because a store without batch calls gains
// nothing from it. In inbox mode ([consumer.NewInbox]) ProcessBatch is
// Process per message. Default off.
func WithBatchProcessing() ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.batchProcessing = true })
}

// WithFetchWait sets how long one pull request waits on an idle stream.
// A stop lets the pending request run out before it releases the messages
// not started (a released message could otherwise be delivered straight
// back to that request, and wait out AckWait), so Close takes up to this
// long; shorter answers Close sooner and sends more requests on an idle
// stream. Default 5s.
func WithFetchWait(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.fetchWait = d })
}

// WithAckWait sets the JetStream consumer's AckWait: how long the broker
// waits for an acknowledgement before it redelivers. While a message is
// held (queued or processing) the consumer sends InProgress every third of
// it, so it only matters after a crash. Default max(30s, 1.25 x the
// processor's lease), so that the first redelivery after a crash finds
// the dead attempt's claim expired and takes it over at once, instead of
// bouncing off it as in progress.
func WithAckWait(d time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.ackWait = d })
}

// WithMaxDeliver sets the JetStream consumer's MaxDeliver. Default -1
// (unlimited): the processor bounds attempts by failure class and
// dead-letters. With a limit, a Retry decision on the last allowed
// delivery is turned into a dead letter ([consumer.Processor.GiveUp]), so
// the broker's limit never drops a message.
func WithMaxDeliver(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.maxDeliver = n })
}

// WithDoubleAck acknowledges with DoubleAck, which waits for the server's
// confirmation, instead of Ack. Default off: a lost Ack only makes the
// broker redeliver, and the redelivery is a duplicate the processor
// acknowledges without running the handler, so the extra round trip per
// message buys one fewer redelivery after a lost packet.
func WithDoubleAck() ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.doubleAck = true })
}

// WithDrainTimeout bounds how long Close (or cancelling Run's context)
// lets the messages being processed finish before their context is
// cancelled. Messages fetched but not started are not run; they are
// released (Nak) for another instance once the pending pull request has
// ended. Default 10s.
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

// WithLogger sets the logger for start-up warnings, failed
// acknowledgements and pull errors; message IDs are logged, payloads
// never. Default slog.Default().
func WithLogger(l *slog.Logger) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.logger = l })
}

// WithWindowWarning calls f for each [WindowWarning] found when Run
// starts, for a metric or an alert. f must be fast. Default none (the
// warning is only logged).
func WithWindowWarning(f func(ctx context.Context, w WindowWarning)) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.onWarning = f })
}

// WithConsumerConfig lets f adjust the JetStream consumer configuration
// (a filter subject, a deliver policy, MaxAckPending, a description)
// after the adapter has filled it in. Run rejects a configuration whose
// AckPolicy is not explicit or that names another durable. AckWait and
// MaxDeliver are read back from the server, so changing them here works.
// Default none.
func WithConsumerConfig(f func(*jetstream.ConsumerConfig)) ConsumerOption {
	return consumerOption(func(c *consumerConfig) {
		if f != nil {
			c.adjust = append(c.adjust, f)
		}
	})
}

// ---- Publisher ----

type publisherConfig struct {
	stream   string
	attempts int
	wait     time.Duration
}

func defaultPublisherConfig() publisherConfig {
	return publisherConfig{attempts: 3, wait: 250 * time.Millisecond}
}

func (c *publisherConfig) validate() error {
	switch {
	case c.attempts < 1:
		return bad("publish attempts", "must be at least 1, got "+strconv.Itoa(c.attempts))
	case c.wait < 0:
		return bad("publish retry wait", "must not be negative")
	case strings.ContainsAny(c.stream, " .*>\t\r\n"):
		return bad("expected stream", strconv.Quote(c.stream)+" is not a stream name")
	}
	return nil
}

// A PublisherOption configures a [Publisher].
type PublisherOption interface{ applyPublisher(*publisherConfig) }

type publisherOption func(*publisherConfig)

func (f publisherOption) applyPublisher(c *publisherConfig) { f(c) }

// WithExpectStream makes every publish fail unless the subject is stored
// in the named stream. Default: any stream.
func WithExpectStream(stream string) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.stream = stream })
}

// WithPublishRetries sets how many times a publish whose outcome is
// unknown (no acknowledgement from the server: a timeout, no responders,
// a reconnect) is attempted, waiting wait between attempts. A retry
// carries the same Nats-Msg-Id, so the broker stores the message once
// when an earlier attempt did land (and reports it as a duplicate). A
// server that answers with an error is not retried. Default 3 attempts,
// 250ms apart.
func WithPublishRetries(attempts int, wait time.Duration) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.attempts, c.wait = attempts, wait })
}

// ---- DLQ ----

type dlqConfig struct {
	prefix     string // "" : "dlq." + stream
	maxAge     time.Duration
	duplicates time.Duration
	replicas   int
	storage    jetstream.StorageType
}

func defaultDLQConfig() dlqConfig {
	return dlqConfig{duplicates: 10 * time.Minute, replicas: 1, storage: jetstream.FileStorage}
}

func (c *dlqConfig) validate() error {
	switch {
	case c.prefix != "" && !validSubject(c.prefix):
		return bad("dead-letter subject prefix", strconv.Quote(c.prefix)+" is not a subject without wildcards")
	case c.maxAge < 0:
		return bad("dead-letter max age", "must not be negative")
	case c.duplicates <= 0:
		return bad("dead-letter duplicate window", "must be positive")
	case c.maxAge > 0 && c.duplicates > c.maxAge:
		return bad("dead-letter duplicate window", "must not exceed the max age")
	case c.replicas < 1 || c.replicas > 5:
		return bad("dead-letter replicas", "must be between 1 and 5")
	}
	return nil
}

// A DLQOption configures a [DLQ].
type DLQOption interface{ applyDLQ(*dlqConfig) }

type dlqOption func(*dlqConfig)

func (f dlqOption) applyDLQ(c *dlqConfig) { f(c) }

// WithSubjectPrefix sets the subjects of the dead-letter stream:
// "<prefix>.>", each record on "<prefix>.<consumer>". Default
// "dlq.<stream>".
func WithSubjectPrefix(prefix string) DLQOption {
	return dlqOption(func(c *dlqConfig) { c.prefix = prefix })
}

// WithMaxAge makes the dead-letter stream delete records older than d.
// Default 0: records are kept until replayed or deleted; the stream never
// discards old records to make room (when a limit set on the server is
// reached, new dead letters are refused and the processor retries the
// message instead).
func WithMaxAge(d time.Duration) DLQOption {
	return dlqOption(func(c *dlqConfig) { c.maxAge = d })
}

// WithDLQDuplicateWindow sets the dead-letter stream's duplicate window,
// within which writing the same dead letter again (after a lost
// acknowledgement) stores it once. Default 10m, well over the processor's
// longest retry delay.
func WithDLQDuplicateWindow(d time.Duration) DLQOption {
	return dlqOption(func(c *dlqConfig) { c.duplicates = d })
}

// WithReplicas sets the dead-letter stream's replicas. Default 1.
func WithReplicas(n int) DLQOption {
	return dlqOption(func(c *dlqConfig) { c.replicas = n })
}

// WithMemoryStorage keeps the dead-letter stream in memory, for tests.
// Default: file storage.
func WithMemoryStorage() DLQOption {
	return dlqOption(func(c *dlqConfig) { c.storage = jetstream.MemoryStorage })
}

// validSubject reports whether s is a literal subject: dot-separated
// non-empty tokens without wildcards or white space.
func validSubject(s string) bool {
	if s == "" || len(s) > 1024 {
		return false
	}
	for _, tok := range strings.Split(s, ".") {
		if tok == "" || tok == "*" || tok == ">" {
			return false
		}
		if strings.ContainsAny(tok, " \t\r\n*>") {
			return false
		}
	}
	return true
}
