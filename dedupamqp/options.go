package dedupamqp

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"time"

	"github.com/dedupkit/dedup"
	amqp "github.com/rabbitmq/amqp091-go"
)

func bad(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

// Queue types the adapter declares.
const (
	Classic = "classic"
	Quorum  = "quorum"
)

// ---- Consumer ----

type consumerConfig struct {
	prefetch      int
	concurrency   int
	batch         int
	queueType     string
	deliveryLimit int
	dlx           string
	declare       bool
	queueArgs     amqp.Table
	retryDelays   []time.Duration
	drain         time.Duration
	reconnectMin  time.Duration
	reconnectMax  time.Duration
	logger        *slog.Logger
	onWarning     func(ctx context.Context, w Warning)
	dial          amqp.Config
}

func defaultConsumerConfig() consumerConfig {
	return consumerConfig{
		prefetch:     64,
		concurrency:  1,
		batch:        1,
		queueType:    Classic,
		declare:      true,
		retryDelays:  []time.Duration{250 * time.Millisecond, time.Second, 5 * time.Second, 30 * time.Second},
		drain:        10 * time.Second,
		reconnectMin: 100 * time.Millisecond,
		reconnectMax: 5 * time.Second,
		logger:       slog.Default(),
	}
}

func (c *consumerConfig) validate() error {
	switch {
	case c.prefetch < 1 || c.prefetch > 65535:
		return bad("prefetch", "must be between 1 and 65535, got "+strconv.Itoa(c.prefetch))
	case c.batch < 1 || c.batch > c.prefetch:
		return bad("batch", "must be between 1 and the prefetch ("+strconv.Itoa(c.prefetch)+"), got "+strconv.Itoa(c.batch))
	case c.concurrency < 1:
		return bad("concurrency", "must be at least 1, got "+strconv.Itoa(c.concurrency))
	case c.concurrency > c.prefetch:
		return bad("concurrency", "must not exceed the prefetch ("+strconv.Itoa(c.prefetch)+"): workers beyond it would never get a message")
	case c.queueType != Classic && c.queueType != Quorum:
		return bad("queue type", strconv.Quote(c.queueType)+" is not classic or quorum")
	case c.deliveryLimit < 0:
		return bad("delivery limit", "must not be negative")
	case c.deliveryLimit > 0 && c.queueType != Quorum:
		return bad("delivery limit", "applies only to quorum queues")
	case len(c.retryDelays) == 0:
		return bad("retry delays", "needs at least one delay")
	case c.drain < 0:
		return bad("drain timeout", "must not be negative")
	case c.reconnectMin <= 0 || c.reconnectMax < c.reconnectMin:
		return bad("reconnect backoff", "needs 0 < min <= max")
	case c.logger == nil:
		return bad("logger", "is nil (pass slog.New(slog.DiscardHandler) to silence it)")
	case c.dial.Recovery != nil:
		return bad("dial config", "must not enable the library's connection recovery: the adapter reconnects itself (see the package documentation)")
	}
	for _, d := range c.retryDelays {
		if d < time.Millisecond || d > 24*time.Hour {
			return bad("retry delays", "each must be between 1ms and 24h, got "+d.String())
		}
	}
	if !validName(c.dlx, true) {
		return bad("dead-letter exchange", strconv.Quote(c.dlx)+" is not an exchange name")
	}
	return nil
}

// A ConsumerOption configures a [Consumer].
type ConsumerOption interface{ applyConsumer(*consumerConfig) }

type consumerOption func(*consumerConfig)

func (f consumerOption) applyConsumer(c *consumerConfig) { f(c) }

// WithPrefetch sets the channel's QoS prefetch count: how many
// unacknowledged messages the broker sends the consumer at once. Default
// 64.
func WithPrefetch(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.prefetch = n })
}

// WithConcurrency sets how many messages are processed at once. Default 1
// (queue order for first deliveries). More trades that order for
// throughput; it must not exceed the prefetch.
func WithConcurrency(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.concurrency = n })
}

// WithBatch lets a worker take up to n deliveries that are already
// waiting (it never waits for more) and run them through
// [consumer.Processor.ProcessBatch]: one store round trip claims them all
// and one completes them, instead of two per message. Each delivery is
// still acknowledged alone, after its own decision. The handlers of a
// batch run one at a time, in delivery order; a batch's claims are held
// until its handlers ran (see ProcessBatch for the leases). Default 1 (no
// batching); n must not exceed the prefetch.
func WithBatch(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.batch = n })
}

// WithQueueType sets the type of the work queue the consumer declares:
// [Classic] or [Quorum]. Default classic.
func WithQueueType(t string) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.queueType = t })
}

// WithDeliveryLimit sets a quorum queue's x-delivery-limit: after that
// many returned deliveries (a crash, a connection drop) the broker
// dead-letters the message to the dead-letter exchange, or drops it when
// there is none. Default 0: not set by the adapter (unlimited before
// RabbitMQ 4, 20 from RabbitMQ 4 on).
func WithDeliveryLimit(n int) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.deliveryLimit = n })
}

// WithDeadLetterExchange sets the work queue's x-dead-letter-exchange,
// where the broker itself sends what it gives up on (a quorum queue's
// delivery limit, a rejection). Pass the exchange of the [DLQ] the
// processor dead-letters to ([DLQ.Exchange]), so both kinds of dead
// letters land in one queue. Default none, which Run warns about.
func WithDeadLetterExchange(name string) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.dlx = name })
}

// WithQueueArgs adds arguments to the work queue's declaration (a
// max-length, a queue leader locator). The adapter's own (x-queue-type,
// x-dead-letter-exchange, x-delivery-limit) are set from their options
// and win. Default none.
func WithQueueArgs(args amqp.Table) ConsumerOption {
	return consumerOption(func(c *consumerConfig) {
		if c.queueArgs == nil {
			c.queueArgs = amqp.Table{}
		}
		for k, v := range args {
			c.queueArgs[k] = v
		}
	})
}

// WithoutDeclare uses a work queue that exists, declared elsewhere: the
// adapter declares only its retry queues, and Run warns that it cannot see
// the queue's dead-letter settings. Default: the adapter declares the work
// queue (durable, with its type, dead-letter exchange and delivery limit).
func WithoutDeclare() ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.declare = false })
}

// WithRetryDelays sets the delays of the retry queues. RabbitMQ has no
// delayed negative acknowledgement, so a Retry decision publishes a copy
// of the message (same message_id, Dedup-Retries one higher) to the retry
// queue "<queue>.retry.<delay>", whose x-message-ttl dead-letters it back
// to the work queue when the delay has passed, and then acknowledges the
// original. Each delay has its own queue so that every message in a queue
// has the same TTL and none waits behind a longer one. A Retry's delay is
// rounded up to the next delay here (the longest when it is longer than
// all). Default 250ms, 1s, 5s, 30s.
func WithRetryDelays(ds ...time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) {
		c.retryDelays = slices.Clone(ds)
		slices.Sort(c.retryDelays)
		c.retryDelays = slices.Compact(c.retryDelays)
	})
}

// WithDrainTimeout bounds how long Close (or cancelling Run's context)
// lets the messages being processed finish before their context is
// cancelled. Messages received but not started are returned to the queue
// when the channel closes. Default 10s.
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

// WithReconnectBackoff sets the delays between reconnection attempts
// after the connection is lost: exponential from min to max, with jitter.
// Default 100ms to 5s.
func WithReconnectBackoff(min, max time.Duration) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.reconnectMin, c.reconnectMax = min, max })
}

// WithLogger sets the logger for start-up warnings, reconnections and
// failed acknowledgements; message IDs are logged, payloads never.
// Default slog.Default().
func WithLogger(l *slog.Logger) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.logger = l })
}

// WithWarning calls f for each [Warning] found when Run starts, for a
// metric or an alert. f must be fast. Default none (warnings are only
// logged).
func WithWarning(f func(ctx context.Context, w Warning)) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.onWarning = f })
}

// WithDialConfig sets the amqp091-go configuration used to connect (TLS,
// heartbeat, a Dial function). Its Recovery must stay nil: the adapter
// reconnects itself. Default: amqp091-go's defaults.
func WithDialConfig(cfg amqp.Config) ConsumerOption {
	return consumerOption(func(c *consumerConfig) { c.dial = cfg })
}

// validName reports whether s can name a queue or an exchange: at most
// 255 bytes, printable, no "amq." prefix.
func validName(s string, emptyOK bool) bool {
	if s == "" {
		return emptyOK
	}
	if len(s) > 255 || len(s) >= 4 && s[:4] == "amq." {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 0x21 || s[i] == 0x7f {
			return false
		}
	}
	return true
}
