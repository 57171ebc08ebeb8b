package consumer

import (
	"log/slog"
	"strconv"
	"time"

	"github.com/dedupkit/dedup"
)

// Limits bound how many failed attempts of each class a message gets
// before it is dead-lettered. A zero field takes its default.
type Limits struct {
	// Transient: default 20.
	Transient int
	// Permanent: default 3 (a deploy that fixes the handler may land
	// within three backoffs; more only delays the dead letter).
	Permanent int
	// Unclassified: default 10.
	Unclassified int
	// Unknown outcomes whose reconcile could not tell: default 10.
	Unknown int
}

func (l Limits) of(c Class) int {
	switch c {
	case ClassTransient:
		return l.Transient
	case ClassPermanent:
		return l.Permanent
	case ClassUnknown:
		return l.Unknown
	}
	return l.Unclassified
}

type config struct {
	scope       string
	key         func(*Message) (dedup.Key, error)
	businessKey bool
	fingerprint func(*Message) dedup.Fingerprint
	lease       time.Duration
	retention   time.Duration
	heartbeat   time.Duration
	baseDelay   time.Duration
	maxDelay    time.Duration
	limits      Limits
	sink        DeadLetterSink
	reconcile   Reconciler
	reason      func(error) string
	maxDeliver  int
	logger      *slog.Logger
	observe     func(m *Message, d Decision)
	clock       dedup.Clock
	runnerOpts  []dedup.RunnerOption
	tracked     int
}

func defaultConfig(name string) config {
	return config{
		scope:     name,
		lease:     30 * time.Second,
		retention: 24 * time.Hour,
		baseDelay: 200 * time.Millisecond,
		maxDelay:  30 * time.Second,
		limits:    Limits{Transient: 20, Permanent: 3, Unclassified: 10, Unknown: 10},
		reason:    safeReason,
		clock:     dedup.SystemClock{},
		tracked:   10000,
	}
}

func (c *config) validate(name string) error {
	bad := func(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }
	switch {
	case name == "":
		return bad("consumer name", "is empty")
	case c.sink == nil:
		return bad("dead-letter sink", "is not set: pass WithDeadLetter (a consumer.MemoryDLQ, or an adapter's dead-letter stream) so a poison message is kept, never dropped")
	case c.lease <= 0:
		return bad("lease", "must be positive")
	case c.retention <= 0:
		return bad("retention", "must be positive")
	case c.baseDelay <= 0 || c.maxDelay < c.baseDelay:
		return bad("backoff", "needs 0 < base <= max, got base "+c.baseDelay.String()+" max "+c.maxDelay.String())
	case c.limits.Transient <= 0 || c.limits.Permanent <= 0 || c.limits.Unclassified <= 0 || c.limits.Unknown <= 0:
		return bad("limits", "every attempt limit must be positive")
	case c.maxDeliver < 0:
		return bad("max deliveries", "must not be negative")
	case c.tracked <= 0:
		return bad("tracked failures", "must be positive, got "+strconv.Itoa(c.tracked))
	}
	k := dedup.Key{Scope: c.scope, ID: "x"}
	if err := k.Validate(); err != nil {
		return bad("scope", err.Error())
	}
	return nil
}

// An Option configures a [Processor].
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

// WithScope sets the dedup key scope of messages. Default: the consumer
// name, so two consumers of one stream deduplicate apart.
func WithScope(scope string) Option { return option(func(c *config) { c.scope = scope }) }

// WithKey derives the dedup key from a message. Default: the scope and
// the message ID (or its business key, see [WithBusinessKey]). A key
// function that fails, or a key that does not validate, dead-letters the
// message at once: no retry can fix it.
func WithKey(f func(*Message) (dedup.Key, error)) Option {
	return option(func(c *config) { c.key = f })
}

// WithBusinessKey keys a message by its BusinessKey when it has one, so
// the same business request published twice under two message IDs has
// one effect. Default: keyed by message ID.
func WithBusinessKey() Option { return option(func(c *config) { c.businessKey = true }) }

// WithFingerprint checks that a key is reused only with the same content:
// a redelivery whose fingerprint differs from the first's is a conflict
// and is dead-lettered. Default: no check (a broker redelivers the same
// bytes).
func WithFingerprint(f func(*Message) dedup.Fingerprint) Option {
	return option(func(c *config) { c.fingerprint = f })
}

// WithPayloadFingerprint is [WithFingerprint] with the SHA-256 of the
// payload.
func WithPayloadFingerprint() Option {
	return WithFingerprint(func(m *Message) dedup.Fingerprint { return dedup.FingerprintOf(m.Payload) })
}

// WithLease sets the claim lease (store mode). Default 30s.
func WithLease(d time.Duration) Option { return option(func(c *config) { c.lease = d }) }

// WithRetention sets how long a processed key is remembered; it must
// cover the longest redelivery or replay you expect. Default 24h.
func WithRetention(d time.Duration) Option { return option(func(c *config) { c.retention = d }) }

// WithHeartbeat extends the claim's lease every d while the handler runs,
// on stores that can (store mode). Default: off.
func WithHeartbeat(d time.Duration) Option { return option(func(c *config) { c.heartbeat = d }) }

// WithBackoff sets the retry delay: full jitter, a uniform draw from
// [0, min(max, base*2^(attempt-1))), never under base/4. Default base
// 200ms, max 30s.
func WithBackoff(base, max time.Duration) Option {
	return option(func(c *config) { c.baseDelay, c.maxDelay = base, max })
}

// WithLimits sets the attempt limits per failure class; zero fields keep
// their defaults.
func WithLimits(l Limits) Option {
	return option(func(c *config) {
		if l.Transient != 0 {
			c.limits.Transient = l.Transient
		}
		if l.Permanent != 0 {
			c.limits.Permanent = l.Permanent
		}
		if l.Unclassified != 0 {
			c.limits.Unclassified = l.Unclassified
		}
		if l.Unknown != 0 {
			c.limits.Unknown = l.Unknown
		}
	})
}

// WithDeadLetter sets where poison messages go. Required.
func WithDeadLetter(s DeadLetterSink) Option { return option(func(c *config) { c.sink = s }) }

// WithReconciler sets the reconciler asked after an [Unknown] failure and
// before running a message whose earlier attempt did not finish. Default:
// none (the handler sees Delivery.TakenOver and must reconcile itself).
func WithReconciler(r Reconciler) Option { return option(func(c *config) { c.reconcile = r }) }

// WithReason turns a handler error into the reason kept in a dead letter
// and logged. Default: the error text, one line, at most 512 bytes.
func WithReason(f func(error) string) Option { return option(func(c *config) { c.reason = f }) }

// WithMaxDeliveries dead-letters, without running it, a message the broker
// has delivered more than n times: the guard against a message that kills
// the process before any failure can be counted. Default 0: off.
func WithMaxDeliveries(n int) Option { return option(func(c *config) { c.maxDeliver = n }) }

// WithLogger logs retries, dead letters, rejections and store failures
// with message ID, business key and class, never the payload. Default:
// no logging.
func WithLogger(l *slog.Logger) Option { return option(func(c *config) { c.logger = l }) }

// WithObserver calls f with every decision, for metrics. f must be fast
// and must not keep m.
func WithObserver(f func(m *Message, d Decision)) Option {
	return option(func(c *config) { c.observe = f })
}

// WithClock sets the clock for failure times. Default: the system clock.
func WithClock(cl dedup.Clock) Option { return option(func(c *config) { c.clock = cl }) }

// WithRunnerOptions passes options (hooks, finalize timeout) to the
// underlying [dedup.Runner] in store mode.
func WithRunnerOptions(opts ...dedup.RunnerOption) Option {
	return option(func(c *config) { c.runnerOpts = append(c.runnerOpts, opts...) })
}

// WithTrackedFailures bounds how many failing keys the processor
// remembers attempt counts for. Default 10,000. When it is full the oldest
// entry is forgotten, and that message's count starts again.
func WithTrackedFailures(n int) Option { return option(func(c *config) { c.tracked = n }) }
