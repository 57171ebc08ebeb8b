package dedup

import (
	"context"
	"time"
)

// A Hook observes deduplication. It is any value that implements one or
// more of [ClaimHook], [DuplicateHook], [TakeoverHook], [FinishHook],
// [StoreErrorHook] and [SweepHook]; a metrics or tracing adapter implements the ones it
// needs. Hooks run synchronously on the caller's goroutine and must be fast
// and must not block. No metrics library is imported here: adapters live in
// their own packages.
type Hook any

// ClaimEvent describes one claim.
type ClaimEvent struct {
	Store     string // the store or layer name given to the runner
	Key       Key
	Outcome   Outcome // zero when Err is set
	Attempt   int
	TakenOver bool
	Duration  time.Duration // store latency
	Err       error
}

// ClaimHook observes every claim, whatever its outcome.
type ClaimHook interface {
	OnClaim(ctx context.Context, e ClaimEvent)
}

// DuplicateEvent describes a duplicate caught by a store or layer.
type DuplicateEvent struct {
	Store string // the store or layer that caught it ("window", "redis", ...)
	Key   Key
}

// DuplicateHook observes duplicates, with the layer that caught them.
type DuplicateHook interface {
	OnDuplicate(ctx context.Context, e DuplicateEvent)
}

// TakeoverEvent describes the take-over of an expired lease: the previous
// owner probably crashed mid-effect, so the effect may have happened once
// already unless it was transactional with the store.
type TakeoverEvent struct {
	Store   string
	Key     Key
	Attempt int
}

// TakeoverHook observes lease take-overs.
type TakeoverHook interface {
	OnTakeover(ctx context.Context, e TakeoverEvent)
}

// FinishEvent describes the end of a claim: completed, released or kept.
type FinishEvent struct {
	Store    string
	Key      Key
	Op       string // "complete", "release" or "keep"
	Duration time.Duration
	Err      error // ErrLeaseLost, a *StoreError, or nil
}

// FinishHook observes Complete and Release.
type FinishHook interface {
	OnFinish(ctx context.Context, e FinishEvent)
}

// StoreErrorEvent describes a failed store call.
type StoreErrorEvent struct {
	Store string
	Op    string
	Key   Key
	Err   error
}

// StoreErrorHook observes store failures (fail-closed events).
type StoreErrorHook interface {
	OnStoreError(ctx context.Context, e StoreErrorEvent)
}

// SweepEvent describes one pass of a store's background sweeper: the
// expired records it deleted and how long the pass took. A pass that
// failed part way reports what it deleted before the failure and its
// error.
type SweepEvent struct {
	Store    string // the store's name ("postgres", "sqlite", or the name given to the sweeper)
	Deleted  int64  // expired records deleted by the pass
	Batches  int    // delete statements run
	Duration time.Duration
	Err      error // nil when the pass succeeded
}

// SweepHook observes sweeper passes.
type SweepHook interface {
	OnSweep(ctx context.Context, e SweepEvent)
}

// Hooks is a set of hooks sorted by the events they observe, built once so
// that emitting an event costs no type assertion. The zero Hooks observes
// nothing. Adapters (HTTP, brokers, layered stores) use it to emit the same
// events as the [Runner].
type Hooks struct {
	claim     []ClaimHook
	duplicate []DuplicateHook
	takeover  []TakeoverHook
	finish    []FinishHook
	storeErr  []StoreErrorHook
	sweep     []SweepHook
}

// NewHooks sorts hs by the interfaces each implements. A value that
// implements none is ignored.
func NewHooks(hs ...Hook) Hooks {
	var h Hooks
	h.Add(hs...)
	return h
}

// Add adds hooks to h.
func (h *Hooks) Add(hs ...Hook) {
	for _, x := range hs {
		if v, ok := x.(ClaimHook); ok {
			h.claim = append(h.claim, v)
		}
		if v, ok := x.(DuplicateHook); ok {
			h.duplicate = append(h.duplicate, v)
		}
		if v, ok := x.(TakeoverHook); ok {
			h.takeover = append(h.takeover, v)
		}
		if v, ok := x.(FinishHook); ok {
			h.finish = append(h.finish, v)
		}
		if v, ok := x.(StoreErrorHook); ok {
			h.storeErr = append(h.storeErr, v)
		}
		if v, ok := x.(SweepHook); ok {
			h.sweep = append(h.sweep, v)
		}
	}
}

// Empty reports whether h observes nothing, so callers can skip timing.
func (h *Hooks) Empty() bool {
	return len(h.claim)+len(h.duplicate)+len(h.takeover)+len(h.finish)+len(h.storeErr)+len(h.sweep) == 0
}

// Claimed emits the events of one claim: the claim itself, then a
// duplicate, a take-over or a store error as the event says.
func (h *Hooks) Claimed(ctx context.Context, e ClaimEvent) {
	for _, x := range h.claim {
		x.OnClaim(ctx, e)
	}
	switch {
	case e.Err != nil:
		h.StoreFailed(ctx, StoreErrorEvent{Store: e.Store, Op: "claim", Key: e.Key, Err: e.Err})
	case e.Outcome == Duplicate:
		for _, x := range h.duplicate {
			x.OnDuplicate(ctx, DuplicateEvent{Store: e.Store, Key: e.Key})
		}
	case e.TakenOver:
		for _, x := range h.takeover {
			x.OnTakeover(ctx, TakeoverEvent{Store: e.Store, Key: e.Key, Attempt: e.Attempt})
		}
	}
}

// Finished emits a finish event, and a store error when e.Err is one.
func (h *Hooks) Finished(ctx context.Context, e FinishEvent) {
	for _, x := range h.finish {
		x.OnFinish(ctx, e)
	}
	if e.Err != nil && IsStoreError(e.Err) {
		h.StoreFailed(ctx, StoreErrorEvent{Store: e.Store, Op: e.Op, Key: e.Key, Err: e.Err})
	}
}

// StoreFailed emits a store error event.
func (h *Hooks) StoreFailed(ctx context.Context, e StoreErrorEvent) {
	for _, x := range h.storeErr {
		x.OnStoreError(ctx, e)
	}
}

// Swept emits a sweep event.
func (h *Hooks) Swept(ctx context.Context, e SweepEvent) {
	for _, x := range h.sweep {
		x.OnSweep(ctx, e)
	}
}

// HookFunc adapts a function to every hook interface: it receives each
// event as an any (one of the *Event types above). Handy in tests and for
// logging.
type HookFunc func(ctx context.Context, event any)

func (f HookFunc) OnClaim(ctx context.Context, e ClaimEvent)           { f(ctx, e) }
func (f HookFunc) OnDuplicate(ctx context.Context, e DuplicateEvent)   { f(ctx, e) }
func (f HookFunc) OnTakeover(ctx context.Context, e TakeoverEvent)     { f(ctx, e) }
func (f HookFunc) OnFinish(ctx context.Context, e FinishEvent)         { f(ctx, e) }
func (f HookFunc) OnStoreError(ctx context.Context, e StoreErrorEvent) { f(ctx, e) }
func (f HookFunc) OnSweep(ctx context.Context, e SweepEvent)           { f(ctx, e) }
