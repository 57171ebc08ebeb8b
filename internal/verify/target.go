package verify

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/dedupkit/dedup"
)

// Mode says how a [Target] makes an effect happen once.
type Mode string

const (
	// LeaseMode claims the key with a lease, applies the effect outside the
	// store, then completes the claim. A crash while holding the claim is
	// recovered when the lease expires and a redelivery takes it over.
	LeaseMode Mode = "lease"
	// InboxMode inserts the dedup record and applies the effect in one SQL
	// transaction, so both commit or neither does.
	InboxMode Mode = "inbox"
	// ApplyMode is InboxMode in one round trip: the effect's statement is
	// queued and sent with the dedup record's claim in one pipeline that
	// the database runs as one transaction (pgstore.Store.Apply).
	ApplyMode Mode = "apply"
)

// Transactional reports whether m commits the dedup record and the effect
// in one transaction, with no lease.
func (m Mode) Transactional() bool { return m == InboxMode || m == ApplyMode }

// Fault is what the broker makes go wrong with one delivery.
type Fault uint8

const (
	// NoFault: the consumer behaves.
	NoFault Fault = iota
	// CrashBeforeCommit: the consumer dies after it owns the key and before
	// anything commits. It neither completes nor releases nor acknowledges.
	CrashBeforeCommit
	// CrashAfterCommit: the consumer dies after the effect and the dedup
	// record are committed, before it acknowledges the delivery.
	CrashAfterCommit
	// HandlerFailure: the handler returns an error before its effect; the
	// claim is released (or the transaction rolled back) and the delivery
	// negatively acknowledged.
	HandlerFailure
)

// String returns the fault's name as the report spells it.
func (f Fault) String() string {
	switch f {
	case NoFault:
		return "none"
	case CrashBeforeCommit:
		return "crash_before_commit"
	case CrashAfterCommit:
		return "crash_after_commit"
	case HandlerFailure:
		return "handler_failure"
	}
	return "fault(" + strconv.Itoa(int(f)) + ")"
}

// A Delivery is one copy of a message handed to a consumer.
type Delivery struct {
	// Seq numbers the message from 0; all copies of a message share it.
	Seq int
	// MsgID is the message's stable ID, the same on every copy.
	MsgID string
	// Key and Fingerprint are what the consumer claims.
	Key         dedup.Key
	Fingerprint dedup.Fingerprint
	// Redelivered counts how often this copy was delivered before.
	Redelivered int
	// Fault is what goes wrong with this delivery. It fires only where it
	// can: a crash before the commit and a handler failure need the
	// consumer to own the key, a crash after the commit needs a commit.
	Fault Fault
}

// Outcome is what happened to one delivery, seen from the broker.
type Outcome uint8

const (
	// Applied: the effect was committed now and the delivery acknowledged.
	Applied Outcome = iota + 1
	// Duplicate: the message was applied before; acknowledged, no effect.
	Duplicate
	// CrashedBeforeCommit: the consumer died holding the key; not
	// acknowledged.
	CrashedBeforeCommit
	// CrashedAfterCommit: the effect committed, then the consumer died
	// before the ack; not acknowledged.
	CrashedAfterCommit
	// HandlerFailed: the handler failed before its effect; the claim was
	// released and the delivery negatively acknowledged.
	HandlerFailed
	// InProgress: another consumer holds a live lease on the key; the
	// delivery is negatively acknowledged and retried after RetryAfter.
	InProgress
	// StoreFailed: the store failed (fail closed); negatively acknowledged.
	StoreFailed
	// LeaseLost: the consumer applied the effect but its lease had been
	// taken over before it could complete; negatively acknowledged.
	LeaseLost
	// Conflict: the store reported a fingerprint mismatch, which verify
	// never causes (every copy of a message carries the same payload). The
	// delivery is dead-lettered (acknowledged) and the run fails.
	Conflict
	// Killed: the consumer's whole process was SIGKILLed (RunProcesses)
	// with the delivery in flight; nothing acknowledged it.
	Killed
)

var outcomeNames = [...]string{
	Applied:             "applied",
	Duplicate:           "duplicate",
	CrashedBeforeCommit: "crashed_before_commit",
	CrashedAfterCommit:  "crashed_after_commit",
	HandlerFailed:       "handler_failed",
	InProgress:          "in_progress",
	StoreFailed:         "store_failed",
	LeaseLost:           "lease_lost",
	Conflict:            "conflict",
	Killed:              "killed",
}

// String returns the outcome's name, such as "crashed_after_commit".
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) && outcomeNames[o] != "" {
		return outcomeNames[o]
	}
	return "outcome(" + strconv.Itoa(int(o)) + ")"
}

// acked reports whether the consumer acknowledges a delivery with this
// outcome, so that the broker forgets it.
func (o Outcome) acked() bool {
	return o == Applied || o == Duplicate || o == Conflict
}

// Result is what a [Target] reports for one delivery.
type Result struct {
	Outcome Outcome
	// TakenOver is set when the consumer acquired the key from an owner
	// whose lease had expired.
	TakenOver bool
	// RetryAfter is when to try again, for InProgress: until the other
	// owner's lease ends.
	RetryAfter time.Duration
	// Err is the error behind StoreFailed, LeaseLost or Conflict.
	Err error
}

// A Target is one store in one mode, as the consumers see it. Adding a
// store to verify means writing a constructor that returns a Target (most
// stores need nothing more than [NewLease]) and listing it in [Backends].
type Target interface {
	// Store names the store for the report ("memory", "sqlite").
	Store() string
	// Mode says how the target applies effects once.
	Mode() Mode
	// Apply handles one delivery: claim the key, apply the effect (one
	// ledger row for d.MsgID), commit, and inject d.Fault where it fires.
	// It is called from many goroutines at once.
	Apply(ctx context.Context, d Delivery) Result
	// Effects counts the ledger rows of each message ID that starts with
	// prefix.
	Effects(ctx context.Context, prefix string) (map[string]int, error)
	// Close releases the store and removes temporary files.
	Close() error
}

// The errors a fault injects into a handler.
var (
	errCrash   = errors.New("verify: injected crash")
	errHandler = errors.New("verify: injected handler failure")
)
