package dedup

import (
	"errors"
	"strings"
	"time"
)

// Sentinel errors a caller branches on with errors.Is.
var (
	// ErrInvalidArgument matches every [*ArgumentError]: a bad key,
	// fingerprint, lease, retention or claim, found before any I/O.
	ErrInvalidArgument = errors.New("dedup: invalid argument")
	// ErrInProgress matches [*InProgressError]: another owner holds a live
	// lease on the key.
	ErrInProgress = errors.New("dedup: key is in progress")
	// ErrFingerprintMismatch: the key is held or completed with another
	// fingerprint; the same key was reused for a different request.
	ErrFingerprintMismatch = errors.New("dedup: key reused with a different fingerprint")
	// ErrLeaseLost: the token no longer owns the record (taken over after
	// the lease expired, released, or the record is gone). Nothing changed.
	ErrLeaseLost = errors.New("dedup: lease lost")
	// ErrClosed: the store was closed.
	ErrClosed = errors.New("dedup: store closed")
	// ErrFull: a bounded store has no room; only in-progress records and
	// live completed records that may not be evicted are left.
	ErrFull = errors.New("dedup: store full")
)

// ArgumentError says which argument is invalid and why. It matches
// [ErrInvalidArgument].
type ArgumentError struct {
	Arg    string // "key id", "lease", ...
	Reason string // "is empty", ...
}

func (e *ArgumentError) Error() string { return "dedup: invalid " + e.Arg + ": " + e.Reason }

// Is makes errors.Is(err, ErrInvalidArgument) true.
func (e *ArgumentError) Is(target error) bool { return target == ErrInvalidArgument }

// InProgressError reports a live lease held by another owner. It matches
// [ErrInProgress].
type InProgressError struct {
	Key        Key
	LeaseUntil time.Time
}

func (e *InProgressError) Error() string {
	return "dedup: key " + e.Key.String() + " is in progress until " + e.LeaseUntil.Format(time.RFC3339Nano)
}

// Is makes errors.Is(err, ErrInProgress) true.
func (e *InProgressError) Is(target error) bool { return target == ErrInProgress }

// RetryAfter returns how long from now until the lease ends, at least zero.
func (e *InProgressError) RetryAfter(now time.Time) time.Duration {
	return max(e.LeaseUntil.Sub(now), 0)
}

// StoreError is a failure of the store itself: unreachable, timed out,
// cancelled, or an unexpected answer. Fail closed on it: after a failed
// Claim do not run the effect and do not acknowledge the message as a
// duplicate; after a failed Complete the record may or may not be completed
// (the lease will expire and the redelivery will find out), so do not
// acknowledge as if it were. The cause stays reachable with errors.Is and
// errors.As (context.Canceled, a driver's error).
type StoreError struct {
	Store string // "sqlite", "redis", ...
	Op    string // "claim", "complete", ...
	Err   error
	// NotApplied is set when the store is certain the operation changed
	// nothing (it was never sent, or its transaction rolled back).
	NotApplied bool
	// Transient is set when the server refused the operation for a
	// passing condition of its own (a deadlock or serialization failure
	// between concurrent transactions) and rolled it back: trying again at
	// once is expected to succeed. [Runner] retries a completion that
	// fails this way before giving up. It implies NotApplied.
	Transient bool
}

func (e *StoreError) Error() string {
	var b strings.Builder
	b.WriteString("dedup: ")
	b.WriteString(e.Store)
	b.WriteString(" store: ")
	b.WriteString(e.Op)
	b.WriteString(": ")
	if e.Err != nil {
		b.WriteString(e.Err.Error())
	}
	return b.String()
}

func (e *StoreError) Unwrap() error { return e.Err }

// SafeToRetry reports whether the operation certainly did not happen, as
// pgconn's SafeToRetry does. An operation that may have been applied is
// never reported safe. Note that retrying Claim or Complete is harmless
// either way: a lost Claim's lease protects the key until it expires, and
// Complete with the same token is idempotent.
func (e *StoreError) SafeToRetry() bool { return e.NotApplied }

// IsTransient reports whether err is or wraps a [*StoreError] whose
// operation was refused by a passing condition and may be retried at once
// (see StoreError.Transient).
func IsTransient(err error) bool {
	if err == nil {
		return false // no errors.As: its target would escape, an allocation a call
	}
	var se *StoreError
	return errors.As(err, &se) && se.Transient
}

// IsStoreError reports whether err is or wraps a [*StoreError].
func IsStoreError(err error) bool {
	if err == nil {
		return false
	}
	var se *StoreError
	return errors.As(err, &se)
}
