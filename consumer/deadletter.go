package consumer

import (
	"context"
	"errors"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// A DeadLetter is a message the processor gave up on, kept whole so it can
// be inspected and replayed under its original IDs.
type DeadLetter struct {
	// ID identifies the record in its dead-letter store (a stream sequence,
	// a row id); set by the store.
	ID string `json:"id,omitempty"`
	// Consumer is the name of the processor that dead-lettered it.
	Consumer string `json:"consumer"`
	// Key is the dedup key the message ran under.
	Key dedup.Key `json:"key"`
	// Message is the original message, payload and headers included.
	Message Message `json:"message"`
	// Class and Reason say why: the failure class and a bounded, one-line
	// reason that never contains the payload unless the handler's own
	// error did (see [WithReason]).
	Class  Class  `json:"class"`
	Reason string `json:"reason"`
	// Attempts is how many times the handler failed on it.
	Attempts int `json:"attempts"`
	// FirstFailure and LastFailure bound the failures this process saw.
	FirstFailure time.Time `json:"first_failure"`
	LastFailure  time.Time `json:"last_failure"`
}

// A DeadLetterSink keeps dead letters. A processor acknowledges a poison
// message only after its sink kept it: if DeadLetter fails the message is
// retried later, never dropped.
type DeadLetterSink interface {
	DeadLetter(ctx context.Context, dl DeadLetter) error
}

// A DeadLetterStore is a sink that can list, read and delete its records,
// for [Replay] and the `dedup dlq` command.
type DeadLetterStore interface {
	DeadLetterSink
	// List returns up to limit records with IDs after the given one ("" for
	// the first), oldest first.
	List(ctx context.Context, after string, limit int) ([]DeadLetter, error)
	// Get returns one record, or an error matching [ErrNotFound].
	Get(ctx context.Context, id string) (DeadLetter, error)
	// Delete removes a record; deleting a missing record is not an error.
	Delete(ctx context.Context, id string) error
}

// ErrNotFound is returned for a dead-letter record that does not exist.
var ErrNotFound = errors.New("consumer: dead letter not found")

// MemoryDLQ is an in-process [DeadLetterStore], for tests and for
// consumers whose dead letters are kept elsewhere by an adapter. It is
// safe for concurrent use; its records are lost with the process.
type MemoryDLQ struct {
	mu   sync.Mutex
	next uint64
	recs []DeadLetter // ordered by ID
}

// DeadLetter keeps a copy of dl under a new ID.
func (q *MemoryDLQ) DeadLetter(ctx context.Context, dl DeadLetter) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	dl.Message = dl.Message.Clone()
	q.mu.Lock()
	q.next++
	dl.ID = strconv.FormatUint(q.next, 10)
	q.recs = append(q.recs, dl)
	q.mu.Unlock()
	return nil
}

// List implements [DeadLetterStore].
func (q *MemoryDLQ) List(ctx context.Context, after string, limit int) ([]DeadLetter, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	from, err := memID(after, true)
	if err != nil {
		return nil, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	i, _ := slices.BinarySearchFunc(q.recs, from+1, func(d DeadLetter, id uint64) int {
		n, _ := strconv.ParseUint(d.ID, 10, 64)
		return cmpUint(n, id)
	})
	end := len(q.recs)
	if limit > 0 {
		end = min(end, i+limit)
	}
	out := make([]DeadLetter, 0, end-i)
	for _, d := range q.recs[i:end] {
		d.Message = d.Message.Clone()
		out = append(out, d)
	}
	return out, nil
}

// Get implements [DeadLetterStore].
func (q *MemoryDLQ) Get(ctx context.Context, id string) (DeadLetter, error) {
	if err := ctx.Err(); err != nil {
		return DeadLetter{}, err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	for _, d := range q.recs {
		if d.ID == id {
			d.Message = d.Message.Clone()
			return d, nil
		}
	}
	return DeadLetter{}, ErrNotFound
}

// Delete implements [DeadLetterStore].
func (q *MemoryDLQ) Delete(ctx context.Context, id string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	q.recs = slices.DeleteFunc(q.recs, func(d DeadLetter) bool { return d.ID == id })
	return nil
}

// Len returns the number of records.
func (q *MemoryDLQ) Len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.recs)
}

func memID(s string, emptyOK bool) (uint64, error) {
	if s == "" && emptyOK {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, &dedup.ArgumentError{Arg: "dead letter id", Reason: strconv.Quote(s) + " is not a record number"}
	}
	return n, nil
}

func cmpUint(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}
