package guard

import (
	"errors"
	"slices"
	"strconv"
	"sync"

	"github.com/dedupkit/dedup"
)

// Errors from [Parked.Park].
var (
	// ErrParkingFull: the parking lot holds its capacity of messages.
	// Nothing was parked; reject the message (nack, retry later) instead
	// of acknowledging it, or it is lost.
	ErrParkingFull = errors.New("guard: parking lot full")
	// ErrAlreadyParked: a message with the same aggregate and version is
	// already parked. The first one is kept; the new one is a duplicate.
	ErrAlreadyParked = errors.New("guard: version already parked")
)

// Parked is a bounded, in-memory parking lot for messages that arrived
// ahead of a missing version (a [Gap] under [GapPark]). When the missing
// version is applied, [Parked.Ready] hands back the parked messages that
// have become next in line, in version order, so the caller can re-drive
// them through the same guarded write.
//
// Parked lives in memory: it is lost on restart. Acknowledge a parked
// message to the broker only if losing it is acceptable; otherwise keep it
// unacknowledged (or rely on redelivery) until it has been applied.
//
// A Parked is safe for concurrent use. The zero value is not usable; call
// [NewParked].
type Parked[T any] struct {
	mu       sync.Mutex
	capacity int
	n        int
	byAgg    map[string]map[uint64]T
}

// NewParked returns an empty parking lot that holds at most capacity
// messages across all aggregates. A capacity below 1 is an error matching
// [dedup.ErrInvalidArgument].
func NewParked[T any](capacity int) (*Parked[T], error) {
	if capacity < 1 {
		return nil, &dedup.ArgumentError{Arg: "capacity", Reason: "must be at least 1, got " + strconv.Itoa(capacity)}
	}
	return &Parked[T]{capacity: capacity, byAgg: make(map[string]map[uint64]T)}, nil
}

// Park holds msg, version version of aggregate, until the versions before
// it are applied. It returns [ErrParkingFull] when the lot is at capacity
// and [ErrAlreadyParked] when that version of that aggregate is already
// parked; in both cases nothing changes.
func (p *Parked[T]) Park(aggregate string, version uint64, msg T) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	vs := p.byAgg[aggregate]
	if _, ok := vs[version]; ok {
		return ErrAlreadyParked
	}
	if p.n >= p.capacity {
		return ErrParkingFull
	}
	if vs == nil {
		vs = make(map[uint64]T)
		p.byAgg[aggregate] = vs
	}
	vs[version] = msg
	p.n++
	return nil
}

// Ready is called after version applied of aggregate has been applied. It
// removes and returns, in version order, the parked messages with versions
// applied+1, applied+2, ... up to the next missing version. Apply them in
// the order given, each through the guarded write, and call Ready again
// only if one fails to apply (re-park the rest or let them be redelivered).
//
// Parked versions at or below applied are left alone: they are now
// duplicates or stale. Remove them with [Parked.Drop].
func (p *Parked[T]) Ready(aggregate string, applied uint64) []T {
	p.mu.Lock()
	defer p.mu.Unlock()
	vs := p.byAgg[aggregate]
	var out []T
	for v := applied + 1; v != 0; v++ {
		msg, ok := vs[v]
		if !ok {
			break
		}
		out = append(out, msg)
		delete(vs, v)
		p.n--
	}
	if len(vs) == 0 {
		delete(p.byAgg, aggregate)
	}
	return out
}

// Drop removes and returns, in version order, the parked messages of
// aggregate with versions at or below upTo: ones that a later apply made
// duplicate or stale. The caller decides what to do with them (usually
// acknowledge them as duplicates); nothing is discarded unseen.
func (p *Parked[T]) Drop(aggregate string, upTo uint64) []T {
	p.mu.Lock()
	defer p.mu.Unlock()
	vs := p.byAgg[aggregate]
	var keys []uint64
	for v := range vs {
		if v <= upTo {
			keys = append(keys, v)
		}
	}
	slices.Sort(keys)
	out := make([]T, 0, len(keys))
	for _, v := range keys {
		out = append(out, vs[v])
		delete(vs, v)
		p.n--
	}
	if len(vs) == 0 {
		delete(p.byAgg, aggregate)
	}
	return out
}

// Versions returns the parked versions of aggregate in ascending order.
func (p *Parked[T]) Versions(aggregate string) []uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []uint64
	for v := range p.byAgg[aggregate] {
		out = append(out, v)
	}
	slices.Sort(out)
	return out
}

// Len returns the number of parked messages across all aggregates.
func (p *Parked[T]) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}
