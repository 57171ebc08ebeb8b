package redistest

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/redisstore"
)

// Held is a real redisstore (see Store) whose one chosen batch completion
// waits for Open, after handing its items to Entered; it counts its batch
// claims in Claims. The pipeline tests use it to hold a batch's completion
// in flight while the next batch runs.
type Held struct {
	*redisstore.Store
	Claims  atomic.Int64
	Entered chan []dedup.Completion // the held completion's items
	pick    func([]dedup.Completion) bool
	held    atomic.Bool
	once    sync.Once
	release chan struct{}
}

// NewHeld opens a Held store under prefix. pick chooses the completion to
// hold (the first it accepts); nil holds the first completion.
func NewHeld(t testing.TB, prefix string, pick func([]dedup.Completion) bool) *Held {
	t.Helper()
	return &Held{Store: Store(t, prefix), Entered: make(chan []dedup.Completion, 1), pick: pick, release: make(chan struct{})}
}

// Open lets the held completion go on. Tests also call it in a cleanup
// registered after the consumer's, which runs first: a test that fails
// while the completion is held would otherwise hang in the consumer's
// Close, which waits for it.
func (s *Held) Open() { s.once.Do(func() { close(s.release) }) }

// Released is closed by Open.
func (s *Held) Released() <-chan struct{} { return s.release }

// ClaimBatch counts the call and claims.
func (s *Held) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	s.Claims.Add(1)
	return s.Store.ClaimBatch(ctx, reqs, lease)
}

// CompleteBatch holds the chosen completion until Open, then completes.
func (s *Held) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	if (s.pick == nil || s.pick(items)) && s.held.CompareAndSwap(false, true) {
		s.Entered <- items
		<-s.release
	}
	return s.Store.CompleteBatch(ctx, items, ret)
}
