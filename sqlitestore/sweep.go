package sqlitestore

import (
	"context"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
)

// SweepBatch is the most records one statement of [Store.SweepExpired]
// and of the background sweeper deletes.
const SweepBatch = 1000

// SweepExpired deletes expired records (see [Store.Sweep]) in batches of
// batch until a batch deletes fewer, waiting pause between batches so that
// claims get the write lock in between, and returns how many it deleted.
// It stops early when ctx ends, returning the count so far and the error.
func (s *Store) SweepExpired(ctx context.Context, batch int, pause time.Duration) (int, error) {
	total := 0
	for {
		n, err := s.Sweep(ctx, batch)
		total += n
		if err != nil || n < batch {
			return total, err
		}
		if pause > 0 {
			t := time.NewTimer(pause)
			select {
			case <-ctx.Done():
				t.Stop()
				return total, s.fail(ctx, "sweep", ctx.Err(), true)
			case <-t.C:
			}
		}
	}
}

// sweeper is the background goroutine of [WithSweepInterval].
type sweeper struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu      sync.Mutex
	deleted int64
	lastErr error
}

// sweepTimeout bounds one background sweep round.
const sweepTimeout = time.Minute

func (s *Store) startSweeper(every time.Duration, hooks dedup.Hooks) {
	if every <= 0 {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	sw := &sweeper{cancel: cancel}
	s.sweeper = sw
	sw.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			rctx, rcancel := context.WithTimeout(ctx, sweepTimeout)
			start := time.Now()
			n, err := s.SweepExpired(rctx, SweepBatch, time.Millisecond)
			took := time.Since(start)
			rcancel()
			sw.mu.Lock()
			sw.deleted += int64(n)
			if ctx.Err() == nil {
				sw.lastErr = err
			}
			sw.mu.Unlock()
			if ctx.Err() != nil {
				err = nil // stopped by Close: not a failure
			}
			hooks.Swept(context.WithoutCancel(ctx), dedup.SweepEvent{Store: "sqlite", Deleted: int64(n), Duration: took, Err: err})
		}
	})
}

// WithSweepHooks gives the background sweeper of [WithSweepInterval] hooks
// that receive a [dedup.SweepEvent] (Store "sqlite") after every round:
// the rows deleted, how long the round took and its error. For a metrics
// adapter (dedupprom, dedupotel). Default none.
func WithSweepHooks(hs ...dedup.Hook) Option {
	return optionFunc(func(c *config) { c.sweepHooks = append(c.sweepHooks, hs...) })
}

// stopSweeper stops the background sweeper, if any, and waits for it.
func (s *Store) stopSweeper() {
	if s.sweeper != nil {
		s.sweeper.cancel()
		s.sweeper.wg.Wait()
	}
}

// SweepStats reports what the background sweeper of [WithSweepInterval]
// has deleted since Open, and the error of its last round (nil when it
// succeeded or when there is no background sweeper).
func (s *Store) SweepStats() (deleted int64, lastErr error) {
	if s.sweeper == nil {
		return 0, nil
	}
	s.sweeper.mu.Lock()
	defer s.sweeper.mu.Unlock()
	return s.sweeper.deleted, s.sweeper.lastErr
}
