package dedupwatermill

import (
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/dedupkit/dedup"
)

// An Option configures a [Middleware].
type Option interface{ apply(*config) }

type option func(*config)

func (f option) apply(c *config) { f(c) }

type config struct {
	keyOf           func(scope string, m *message.Message) (dedup.Key, error)
	fingerprintOf   func(m *message.Message) (dedup.Fingerprint, error)
	lease           time.Duration
	retention       time.Duration
	heartbeat       time.Duration
	finalizeTimeout time.Duration
	pollInterval    time.Duration
	completeTries   int
	classify        func(error) dedup.Disposition
}

func defaultConfig() config {
	return config{
		keyOf:           uuidKey,
		fingerprintOf:   payloadFingerprint,
		lease:           30 * time.Second,
		retention:       24 * time.Hour,
		finalizeTimeout: 10 * time.Second,
		pollInterval:    time.Millisecond,
		completeTries:   5,
		classify:        Classify,
	}
}

func (c *config) validate() error {
	switch {
	case c.keyOf == nil:
		return bad("key function", "is nil")
	case c.fingerprintOf == nil:
		return bad("fingerprint function", "is nil")
	case c.classify == nil:
		return bad("classifier", "is nil")
	case c.lease <= 0:
		return bad("lease", "must be positive, got "+c.lease.String())
	case c.retention <= 0:
		return bad("retention", "must be positive, got "+c.retention.String())
	case c.finalizeTimeout <= 0:
		return bad("finalize timeout", "must be positive, got "+c.finalizeTimeout.String())
	case c.pollInterval <= 0:
		return bad("ack poll interval", "must be positive, got "+c.pollInterval.String())
	case c.heartbeat < 0 || (c.heartbeat > 0 && c.heartbeat >= c.lease):
		return bad("heartbeat", "must be positive and shorter than the lease ("+c.lease.String()+"), got "+c.heartbeat.String())
	case c.completeTries < 1 || c.completeTries > 100:
		return bad("complete attempts", "must be between 1 and 100, got "+strconv.Itoa(c.completeTries))
	}
	return nil
}

func bad(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

// uuidKey is the default key: the message's UUID in the middleware's scope.
func uuidKey(scope string, m *message.Message) (dedup.Key, error) {
	return dedup.Key{Scope: scope, ID: m.UUID}, nil
}

// payloadFingerprint is the default fingerprint: SHA-256 of the payload.
func payloadFingerprint(m *message.Message) (dedup.Fingerprint, error) {
	return dedup.FingerprintOf(m.Payload), nil
}

// WithMetadataKey takes the key's ID from the metadata field name instead
// of the message UUID: a producer's stable event ID carried in a header,
// or a business key the producer computed. A message without the field
// (or with it empty) fails with an [*dedup.ArgumentError] before the store
// is asked; nothing runs and the error goes to the router (and to the
// poison queue when one is set). Default: the message UUID.
func WithMetadataKey(name string) Option {
	return option(func(c *config) {
		if name == "" {
			c.keyOf = nil
			return
		}
		c.keyOf = func(scope string, m *message.Message) (dedup.Key, error) {
			id := m.Metadata.Get(name)
			if id == "" {
				return dedup.Key{}, bad("metadata "+strconv.Quote(name), "is missing or empty on message "+strconv.Quote(m.UUID))
			}
			return dedup.Key{Scope: scope, ID: id}, nil
		}
	})
}

// WithKeyFunc derives the key from the message with f, for business keys
// (two messages with different UUIDs that carry the same intent, built
// with [dedup.BusinessKey] from payload fields for example). f receives the
// middleware's scope; an error from f is returned to the router as is
// and the handler does not run. Default: the message UUID.
func WithKeyFunc(f func(scope string, m *message.Message) (dedup.Key, error)) Option {
	return option(func(c *config) { c.keyOf = f })
}

// WithFingerprint sets how the fingerprint stored with a claim is
// computed; the same key seen with another fingerprint is a conflict
// ([dedup.ErrFingerprintMismatch]), never a duplicate. Return "" to skip
// the check. An error from f is returned to the router and the handler
// does not run. Default: SHA-256 of the payload ([dedup.FingerprintOf]).
func WithFingerprint(f func(m *message.Message) (dedup.Fingerprint, error)) Option {
	return option(func(c *config) { c.fingerprintOf = f })
}

// WithoutFingerprint claims with the empty fingerprint (not checked), for
// business keys whose payloads legitimately differ between duplicates.
func WithoutFingerprint() Option {
	return WithFingerprint(func(*message.Message) (dedup.Fingerprint, error) { return "", nil })
}

// WithLease sets how long a claim is owned before another delivery may
// take it over. It must cover the handler and the router's publish of its
// produced messages, or use [WithHeartbeat]. Default 30s.
func WithLease(d time.Duration) Option { return option(func(c *config) { c.lease = d }) }

// WithRetention sets how long a completed key is remembered; make it
// cover the broker's replay horizon. Default 24h.
func WithRetention(d time.Duration) Option { return option(func(c *config) { c.retention = d }) }

// WithHeartbeat extends the lease every d, from the claim until the
// message is acked or nacked, on stores that implement [dedup.Extender].
// If an extension finds the lease lost, the message's context is
// cancelled with cause [dedup.ErrLeaseLost]. d must be shorter than the
// lease. Default 0: no heartbeat.
func WithHeartbeat(d time.Duration) Option { return option(func(c *config) { c.heartbeat = d }) }

// WithFinalizeTimeout bounds each completion and release; they run on a
// context detached from the message's, so a shutdown does not lose a
// completion. Default 10s.
func WithFinalizeTimeout(d time.Duration) Option {
	return option(func(c *config) { c.finalizeTimeout = d })
}

// WithAckPollInterval sets how often the middleware's completer looks
// again at messages whose handler returned but that the router has not
// acked or nacked yet. Completions of messages acked together are sent to
// the store in one batch. Default 1ms.
func WithAckPollInterval(d time.Duration) Option {
	return option(func(c *config) { c.pollInterval = d })
}

// WithCompleteAttempts sets how many times a completion the store refused
// for a passing condition ([dedup.IsTransient]) is tried. Default 5.
func WithCompleteAttempts(n int) Option { return option(func(c *config) { c.completeTries = n }) }

// WithClassifier decides what happens to the claim when the handler
// returns an error: [dedup.Release] (the redelivery runs it again at
// once), [dedup.Keep] (an unknown outcome: the key stays claimed until the
// lease ends, then a redelivery takes it over and the handler sees
// Claim.TakenOver) or [dedup.Record] (a final outcome: the key is
// completed and the middleware returns nil so that the router acks).
// Default [Classify].
func WithClassifier(f func(error) dedup.Disposition) Option {
	return option(func(c *config) { c.classify = f })
}
