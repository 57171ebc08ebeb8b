package dedup

import (
	"context"
	"encoding/hex"
	"math/rand/v2"
	"strconv"
	"time"
)

// Outcome is what a claim found.
type Outcome uint8

const (
	// Acquired: the caller owns the key until its lease ends and must
	// Complete or Release it. The record was absent, completed and expired,
	// or in progress with an expired lease (then Claim.TakenOver is set).
	Acquired Outcome = iota + 1
	// InProgress: another owner holds a live lease. Back off or nack with a
	// delay until about Claim.LeaseUntil; do not run the effect.
	InProgress
	// Duplicate: the key was completed within its retention. Claim.Result
	// holds what the first run stored. Acknowledge; do not run the effect.
	Duplicate
	// Mismatch: the key is in progress or completed with another
	// fingerprint. The key is reused for a different request: a conflict,
	// never a duplicate. See [ErrFingerprintMismatch].
	Mismatch
)

func (o Outcome) String() string {
	switch o {
	case Acquired:
		return "acquired"
	case InProgress:
		return "in_progress"
	case Duplicate:
		return "duplicate"
	case Mismatch:
		return "fingerprint_mismatch"
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// A Token fences one ownership of a key. A new one is drawn for every
// acquisition, so an owner whose lease was taken over cannot complete or
// release the record of the new owner. The zero Token is never issued.
type Token [16]byte

// NewToken returns a random token. It reads the runtime's ChaCha8 generator
// (seeded by the operating system), which does not allocate or make a
// system call; 128 random bits make a collision between two owners of one
// key negligible.
func NewToken() Token {
	var t Token
	for {
		a, b := rand.Uint64(), rand.Uint64()
		for i := range 8 {
			t[i] = byte(a >> (8 * i))
			t[8+i] = byte(b >> (8 * i))
		}
		if !t.IsZero() {
			return t
		}
	}
}

// IsZero reports whether t is the zero Token.
func (t Token) IsZero() bool { return t == Token{} }

// String returns t in hex.
func (t Token) String() string { return hex.EncodeToString(t[:]) }

// A Claim is the answer of [Store.Claim]. Pass an acquired Claim back to
// Complete, Release or Extend; the store uses its Key and Token.
type Claim struct {
	Key     Key
	Outcome Outcome
	// Token is set when Outcome is Acquired.
	Token Token
	// Attempt counts acquisitions of the key since it was last absent:
	// 1 for a first claim, +1 for each take-over of an expired lease.
	// Set for Acquired and InProgress.
	Attempt int
	// TakenOver is set when this acquisition replaced an owner whose lease
	// had expired (the owner probably crashed mid-effect).
	TakenOver bool
	// LeaseUntil is when the lease ends: the caller's own lease when
	// Acquired, the other owner's when InProgress (a Retry-After).
	LeaseUntil time.Time
	// Result is what Complete stored, when Outcome is Duplicate. It is the
	// caller's copy.
	Result []byte
	// ExpiresAt is when a Duplicate's record expires and the key is new again.
	ExpiresAt time.Time
}

// Err returns nil for Acquired and Duplicate, an [*InProgressError] for
// InProgress and [ErrFingerprintMismatch] for Mismatch.
func (c Claim) Err() error {
	switch c.Outcome {
	case Acquired, Duplicate:
		return nil
	case InProgress:
		return &InProgressError{Key: c.Key, LeaseUntil: c.LeaseUntil}
	case Mismatch:
		return ErrFingerprintMismatch
	}
	return &ArgumentError{Arg: "claim", Reason: "has no outcome"}
}

// Store is the claim contract every engine implements. Every method is one
// atomic step in the store (a composite store such as layered.Store is
// linearizable instead: each call takes effect at one instant, its
// durable store's step); the state table is in docs/DESIGN.md.
//
// Errors: invalid arguments give an [*ArgumentError] before any I/O; an
// unreachable store, a timeout or a cancelled context gives a
// [*StoreError] (fail closed: the caller must neither proceed nor treat the
// message as a duplicate); a fenced call whose token no longer owns the
// record gives [ErrLeaseLost]; any call after Close gives [ErrClosed].
type Store interface {
	// Claim asks to own key for lease. See [Outcome] for the answers.
	Claim(ctx context.Context, key Key, fp Fingerprint, lease time.Duration) (Claim, error)
	// Complete marks an acquired claim done, storing result (which may be
	// nil) for retention. Completing again with the same token is a no-op.
	// A lease that ran out but was not taken over yet may still complete.
	Complete(ctx context.Context, c Claim, result []byte, retention time.Duration) error
	// Release gives up an acquired claim: the record is removed and the
	// next claim acquires at once with attempt 1. It never removes a
	// completed record.
	Release(ctx context.Context, c Claim) error
	// Close releases the store's resources; later calls return ErrClosed.
	Close() error
}

// Extender is a store that can move a live lease forward, for handlers that
// outlast one lease.
type Extender interface {
	// Extend sets the lease of an acquired claim to now + lease and returns
	// the claim with its new LeaseUntil, or ErrLeaseLost.
	Extend(ctx context.Context, c Claim, lease time.Duration) (Claim, error)
}

// A ClaimRequest is one key of a batch claim.
type ClaimRequest struct {
	Key         Key
	Fingerprint Fingerprint
}

// BatchClaimer is a store that can claim many keys in one round trip.
type BatchClaimer interface {
	// ClaimBatch returns one Claim per request, in order, with the
	// semantics of Claim as if each were claimed alone in some order. A key
	// repeated inside the batch is acquired by its first request; the
	// others report InProgress.
	ClaimBatch(ctx context.Context, reqs []ClaimRequest, lease time.Duration) ([]Claim, error)
}

// A Completion is one item of a batch completion: an acquired Claim and
// the result to store with it (which may be nil).
type Completion struct {
	Claim  Claim
	Result []byte
}

// BatchCompleter is a store that can complete many claims in one round
// trip.
type BatchCompleter interface {
	// CompleteBatch completes each item as Complete would, each with
	// retention, and returns one error per item, in order: nil when the item
	// is completed (or was already completed by the same token), or
	// ErrLeaseLost when its token no longer owns the record, which is then
	// unchanged. Items are independent: one fenced out item does not stop
	// the others. The second result is a failure of the whole call, with a
	// nil slice: an [*ArgumentError] when any item or retention is invalid
	// (nothing was sent), [ErrClosed], or a [*StoreError] (unreachable, timed
	// out, cancelled), after which any item may or may not be completed, as
	// after a failed Complete. A store that sends the items separately may
	// also report a *StoreError for one item alone. Implementations check
	// their input with [ValidateCompleteBatch] before any I/O.
	CompleteBatch(ctx context.Context, items []Completion, retention time.Duration) ([]error, error)
}

// Sweeper is a store that can delete expired records in bounded batches.
type Sweeper interface {
	// Sweep deletes up to limit expired records and returns how many it
	// deleted. Expired records are already invisible to Claim; sweeping
	// only reclaims space.
	Sweep(ctx context.Context, limit int) (int, error)
}

// Pinger is a store that can check that its server answers.
type Pinger interface {
	Ping(ctx context.Context) error
}

// A ClaimedRecord is a key's record as a single-statement claim reports it: an
// upsert that takes the row only when it is acquirable and returns the row
// as it ended up (SQL's INSERT ... ON CONFLICT DO UPDATE ... RETURNING).
// Stores that decide that way turn it into the caller's Claim with
// [ClaimedRecord.ClaimFor], so every such store reads the answer the same way.
type ClaimedRecord struct {
	Completed   bool
	Token       []byte
	Attempts    int
	Fingerprint Fingerprint
	Result      []byte
	LeaseUntil  time.Time
	ExpiresAt   time.Time
}

// ClaimFor returns the Claim of the caller that tried to acquire key with
// fp and the new token own. The caller acquired the key if and only if the
// record carries own (the statement decided that, atomically); otherwise
// the record is the one that stopped it: a mismatch if the fingerprints
// disagree, else in progress or a duplicate. Pass the zero Token for a
// caller that did not run the statement itself (a key repeated in a batch).
// Result is returned as is (the caller's copy) and nil when empty.
func (r *ClaimedRecord) ClaimFor(key Key, fp Fingerprint, own Token) Claim {
	c := Claim{Key: key, Attempt: r.Attempts}
	switch {
	case !own.IsZero() && string(r.Token) == string(own[:]):
		c.Outcome, c.Token, c.TakenOver = Acquired, own, r.Attempts > 1
		if r.Completed { // an inbox record, completed at once
			c.ExpiresAt = r.ExpiresAt
		} else {
			c.LeaseUntil = r.LeaseUntil
		}
	case !fp.Matches(r.Fingerprint):
		c.Outcome, c.Attempt = Mismatch, 0
	case !r.Completed:
		c.Outcome, c.LeaseUntil = InProgress, r.LeaseUntil
	default:
		c.Outcome, c.ExpiresAt = Duplicate, r.ExpiresAt
		if len(r.Result) > 0 {
			c.Result = r.Result
		}
	}
	return c
}

// ClaimBatch claims reqs on s in one round trip when s is a [BatchClaimer],
// and one by one otherwise, with the same per-key results. The fallback
// checks every request before it claims any, and when a claim fails it
// releases the keys it acquired before returning the error, since the
// caller gets no claims to release.
func ClaimBatch(ctx context.Context, s Store, reqs []ClaimRequest, lease time.Duration) ([]Claim, error) {
	if b, ok := s.(BatchClaimer); ok {
		return b.ClaimBatch(ctx, reqs, lease)
	}
	if err := ValidateBatch(reqs, lease); err != nil {
		return nil, err
	}
	out := make([]Claim, len(reqs))
	for i, r := range reqs {
		c, err := s.Claim(ctx, r.Key, r.Fingerprint, lease)
		if err != nil {
			for _, c := range out[:i] {
				if c.Outcome == Acquired {
					_ = s.Release(ctx, c) // best effort: otherwise the lease ends it
				}
			}
			return nil, err
		}
		out[i] = c
	}
	return out, nil
}

// CompleteBatch completes items on s in one round trip when s is a
// [BatchCompleter], and with one Complete per item otherwise, with the same
// per-item results (see [BatchCompleter]). Either way an invalid item fails
// the whole call with an [*ArgumentError] before any item is sent: the
// fallback checks every item first, as [ValidateCompleteBatch] does, and
// reports a failure of one Complete as that item's error and goes on with
// the next.
func CompleteBatch(ctx context.Context, s Store, items []Completion, retention time.Duration) ([]error, error) {
	if b, ok := s.(BatchCompleter); ok {
		return b.CompleteBatch(ctx, items, retention)
	}
	if err := ValidateCompleteBatch(items, retention); err != nil {
		return nil, err
	}
	errs := make([]error, len(items))
	for i, it := range items {
		errs[i] = s.Complete(ctx, it.Claim, it.Result, retention)
	}
	return errs, nil
}

// A Clock tells the time. Stores that keep time themselves (memory,
// SQLite) take one so that leases and retention can be tested without
// sleeping; stores with a server use the server's clock.
type Clock interface {
	Now() time.Time
}

// SystemClock is the [Clock] of time.Now.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// ValidateClaim checks the arguments of Claim. Stores call it before any I/O.
func ValidateClaim(key Key, fp Fingerprint, lease time.Duration) error {
	if err := key.Validate(); err != nil {
		return err
	}
	if err := fp.validate(); err != nil {
		return err
	}
	return validateDuration("lease", lease)
}

// ValidateBatch checks the arguments of ClaimBatch: every request as
// ValidateClaim does. The error names the request's index.
func ValidateBatch(reqs []ClaimRequest, lease time.Duration) error {
	for i, r := range reqs {
		if err := ValidateClaim(r.Key, r.Fingerprint, lease); err != nil {
			return indexed(err, "claim request", i)
		}
	}
	return nil
}

// ValidateComplete checks the arguments of Complete.
func ValidateComplete(c Claim, retention time.Duration) error {
	if err := ValidateRelease(c); err != nil {
		return err
	}
	return validateDuration("retention", retention)
}

// ValidateCompleteBatch checks the arguments of CompleteBatch: every item
// as ValidateComplete does. The error names the item's index.
func ValidateCompleteBatch(items []Completion, retention time.Duration) error {
	if err := validateDuration("retention", retention); err != nil {
		return err
	}
	for i, it := range items {
		if err := ValidateRelease(it.Claim); err != nil {
			return indexed(err, "completion", i)
		}
	}
	return nil
}

// indexed names the item of a batch in an argument error.
func indexed(err error, item string, i int) error {
	if ae, ok := err.(*ArgumentError); ok {
		return &ArgumentError{Arg: ae.Arg + " of " + item + " " + strconv.Itoa(i), Reason: ae.Reason}
	}
	return err
}

// ValidateRelease checks the claim given to Release, Complete or Extend: it
// must have been acquired.
func ValidateRelease(c Claim) error {
	if err := c.Key.Validate(); err != nil {
		return err
	}
	if c.Outcome != Acquired || c.Token.IsZero() {
		return &ArgumentError{Arg: "claim", Reason: "was not acquired (outcome " + c.Outcome.String() + ")"}
	}
	return nil
}

func validateDuration(arg string, d time.Duration) error {
	if d <= 0 {
		return &ArgumentError{Arg: arg, Reason: "must be positive, got " + d.String()}
	}
	return nil
}
