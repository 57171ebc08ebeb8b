// Package brokenstore holds deliberately wrong stores. They exist to prove
// that the conformance suite and `dedup verify` can fail: each reproduces a
// design found in the wild.
package brokenstore

import (
	"context"
	"runtime"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

type record struct {
	token     dedup.Token
	fp        dedup.Fingerprint
	completed bool
	until     time.Time // lease end or expiry
	attempt   int
	result    []byte
}

// CheckThenSet has the right state machine but reads, decides and writes in
// two separate locked sections, so concurrent claims of one key can all
// acquire it.
type CheckThenSet struct {
	mu     sync.Mutex
	m      map[dedup.Key]*record
	closed bool
	window time.Duration
}

// NewCheckThenSet returns an empty CheckThenSet store.
func NewCheckThenSet() *CheckThenSet { return &CheckThenSet{m: map[dedup.Key]*record{}} }

// WithWindow makes every claim wait d between its check and its write (the
// default only yields the processor). Over a broker, where the two copies of
// a message reach two consumers at moments the test does not control, a
// window of a millisecond or two makes the race this store has certain to
// show within a run instead of merely likely.
func (s *CheckThenSet) WithWindow(d time.Duration) *CheckThenSet {
	s.window = d
	return s
}

func (s *CheckThenSet) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, &dedup.StoreError{Store: "check-then-set", Op: "claim", Err: err, NotApplied: true}
	}
	now := time.Now()
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return dedup.Claim{}, dedup.ErrClosed
	}
	r, ok := s.m[key]
	var snapshot record
	if ok {
		snapshot = *r
	}
	s.mu.Unlock()

	if ok {
		live := now.Before(snapshot.until)
		switch {
		case !fp.Matches(snapshot.fp) && (live || !snapshot.completed):
			return dedup.Claim{Key: key, Outcome: dedup.Mismatch}, nil
		case snapshot.completed && live:
			return dedup.Claim{Key: key, Outcome: dedup.Duplicate, Result: snapshot.result, ExpiresAt: snapshot.until}, nil
		case live:
			return dedup.Claim{Key: key, Outcome: dedup.InProgress, Attempt: snapshot.attempt, LeaseUntil: snapshot.until}, nil
		}
	}
	// The window every check-then-set has; this only widens it.
	if s.window > 0 {
		time.Sleep(s.window)
	} else {
		runtime.Gosched()
	}

	attempt := 1
	if ok && !snapshot.completed {
		attempt = snapshot.attempt + 1
	}
	nr := &record{token: dedup.NewToken(), fp: fp, until: now.Add(lease), attempt: attempt}
	s.mu.Lock()
	s.m[key] = nr
	s.mu.Unlock()
	return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: nr.token, Attempt: attempt, TakenOver: attempt > 1, LeaseUntil: nr.until}, nil
}

func (s *CheckThenSet) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if err := dedup.ValidateComplete(c, retention); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dedup.ErrClosed
	}
	r, ok := s.m[c.Key]
	if !ok || r.token != c.Token {
		return dedup.ErrLeaseLost
	}
	if !r.completed {
		r.completed, r.result, r.until = true, append([]byte(nil), result...), time.Now().Add(retention)
	}
	return nil
}

func (s *CheckThenSet) Release(ctx context.Context, c dedup.Claim) error {
	if err := dedup.ValidateRelease(c); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dedup.ErrClosed
	}
	r, ok := s.m[c.Key]
	if !ok || r.token != c.Token || r.completed {
		return dedup.ErrLeaseLost
	}
	delete(s.m, c.Key)
	return nil
}

func (s *CheckThenSet) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return nil
}

// MarkFirst is the "SET NX, then process" design: Claim marks the key as
// done at once, so Complete and Release change nothing. A handler that fails
// after the claim loses the message, because the redelivery is a duplicate.
type MarkFirst struct {
	mu     sync.Mutex
	m      map[dedup.Key]bool
	closed bool
}

// NewMarkFirst returns an empty MarkFirst store.
func NewMarkFirst() *MarkFirst { return &MarkFirst{m: map[dedup.Key]bool{}} }

func (s *MarkFirst) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := dedup.ValidateClaim(key, fp, lease); err != nil {
		return dedup.Claim{}, err
	}
	if err := ctx.Err(); err != nil {
		return dedup.Claim{}, &dedup.StoreError{Store: "mark-first", Op: "claim", Err: err, NotApplied: true}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return dedup.Claim{}, dedup.ErrClosed
	}
	if s.m[key] {
		return dedup.Claim{Key: key, Outcome: dedup.Duplicate}, nil
	}
	s.m[key] = true
	return dedup.Claim{Key: key, Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1, LeaseUntil: time.Now().Add(lease)}, nil
}

func (s *MarkFirst) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	return dedup.ValidateComplete(c, retention)
}

func (s *MarkFirst) Release(ctx context.Context, c dedup.Claim) error {
	return dedup.ValidateRelease(c)
}

func (s *MarkFirst) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return nil
}
