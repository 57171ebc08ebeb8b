package outbox

import (
	"context"
	"time"
)

// A Lease is a relay's hold on one partition of the key space, granted
// by the store's clock. Epoch is the fencing token: it grows on every
// change of owner, and every write a relay makes for the partition
// (marking, recording a failure) carries it, so that a relay whose lease
// was taken over cannot change a row any more.
type Lease struct {
	Partition int
	Owner     string
	Epoch     int64
	Until     time.Time
}

// A Failure is one failed publish attempt, recorded by [Source.Fail].
type Failure struct {
	Seq int64
	// Err is the broker's error, kept with the row for the operator.
	Err string
	// RetryAfter delays the row's next attempt (and every later row of
	// its key) by this much, on the store's clock.
	RetryAfter time.Duration
	// Quarantine moves the row aside: the relay no longer reads it until
	// an operator retries or drops it.
	Quarantine bool
}

// A Source is an outbox table as the relay sees it. pgstore and
// sqlitestore implement it; a relay needs nothing else from a store.
// Every method does I/O and takes ctx first. A Source must be safe for
// concurrent use.
type Source interface {
	// Partitions is N, the number of partitions the key space is split
	// into: a Message belongs to partition hash(Key) mod N. Every relay
	// of one outbox must use the same N.
	Partitions() int
	// Join records relay as alive until ttl from now and returns how
	// many relays are alive, itself included (each relay then takes its
	// fair share of partitions).
	Join(ctx context.Context, relay string, ttl time.Duration) (alive int, err error)
	// Leave forgets relay and releases its leases.
	Leave(ctx context.Context, relay string) error
	// Acquire takes partition p for relay until ttl from now, or renews
	// relay's lease on it. ok is false when another relay holds a live
	// lease on p. A take-over gives a new Epoch.
	Acquire(ctx context.Context, relay string, p int, ttl time.Duration) (l Lease, ok bool, err error)
	// Release gives l up at once, if l is still held.
	Release(ctx context.Context, l Lease) error
	// Fetch returns up to limit messages of l.Partition that are neither
	// published nor quarantined, in publish order (by Seq), with each
	// key's messages cut at its first row that is not due yet (its retry
	// delay has not passed) and, when skipBlocked is false, without the
	// keys that have a quarantined row before them.
	Fetch(ctx context.Context, l Lease, limit int, skipBlocked bool) ([]Message, error)
	// Mark records seqs as published, in one statement, if l is still
	// held; otherwise it changes nothing and returns [ErrLeaseLost].
	Mark(ctx context.Context, l Lease, seqs []int64) error
	// Fail records failed attempts, under the same fencing as Mark.
	Fail(ctx context.Context, l Lease, failures []Failure) error
}

// A Prefetcher is a [Source] that can read a partition's next batch
// while the current one is at the broker. FetchNext returns up to limit
// messages of l.Partition, in Seq order, that [Source.Fetch] would
// return first once every message of inflight (the batch being
// published, as Fetch returned it) were marked published; it may return
// fewer (a row committed late with a Seq below inflight's, or a key cut
// by such a row, waits for the next Fetch). The relay uses it only after
// a full batch (a backlog remains) and keeps what it read only when every
// message of the batch in flight was acknowledged and marked; otherwise
// it throws it away and reads afresh.
type Prefetcher interface {
	FetchNext(ctx context.Context, l Lease, inflight []Message, limit int, skipBlocked bool) ([]Message, error)
}

// A Notifier is a [Source] that can wake the relay when rows are written
// (PostgreSQL's LISTEN/NOTIFY). Listen calls wake after each
// notification until ctx is done (then it returns nil) or its connection
// fails (an error; the relay listens again after a pause, and polls
// meanwhile).
type Notifier interface {
	Listen(ctx context.Context, wake func()) error
}

// A Pruner is a [Source] that deletes published rows after a retention:
// up to limit rows published more than olderThan ago, returning how many.
// It never deletes an unpublished row.
type Pruner interface {
	Prune(ctx context.Context, olderThan time.Duration, limit int) (int, error)
}
