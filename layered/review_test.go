package layered_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
)

// stuckFilter is a filter on a Redis that stopped answering: every
// Remember blocks until released (or its context ends) and reports that
// it started; lookups miss at once.
type stuckFilter struct {
	entered chan struct{}
	release chan struct{}
}

func (f *stuckFilter) Lookup(context.Context, dedup.Key) ([]byte, bool, error) {
	return nil, false, nil
}

func (f *stuckFilter) Remember(ctx context.Context, _ []layered.FilterEntry) error {
	select {
	case f.entered <- struct{}{}:
	default:
	}
	select {
	case <-f.release:
	case <-ctx.Done():
	}
	return nil
}

// TestFilterStuckNeverBlocksComplete: a filter that hangs (a Redis that
// stopped answering) fills the write queue; a completion that finds the
// queue full must still return at once (the entry is dropped and counted,
// an entry only saves a later lookup), never send it inline and wait for
// the filter on the caller's path. The test completes new keys while the
// writer is stuck in its first Remember until either a completion reports
// the drop (pass) or a second Remember starts, which can only be a
// caller's inline write (fail).
func TestFilterStuckNeverBlocksComplete(t *testing.T) {
	f := &stuckFilter{entered: make(chan struct{}, 8), release: make(chan struct{})}
	lay := newLayered(t, layered.WithFilter(f, "filter"), layered.WithDurable(mem(t, dedup.SystemClock{}), "durable"),
		layered.WithCleanupTimeout(time.Hour))
	released := false
	defer func() {
		if !released {
			close(f.release)
		}
	}()
	ctx := context.Background()
	scope := fmt.Sprintf("rev1-stuck-%d", time.Now().UnixNano())
	complete := func(i int) <-chan error {
		done := make(chan error, 1)
		go func() {
			c, err := lay.Claim(ctx, dedup.Key{Scope: scope, ID: fmt.Sprint("m", i)}, "", time.Minute)
			if err == nil {
				err = lay.Complete(ctx, c, nil, time.Hour)
			}
			done <- err
		}()
		return done
	}
	if err := <-complete(0); err != nil {
		t.Fatal(err)
	}
	<-f.entered // the writer is stuck sending the first entry
	for i := 1; i <= 4096+256+1; i++ {
		select {
		case err := <-complete(i):
			if err != nil {
				t.Fatal(err)
			}
		case <-f.entered:
			t.Fatalf("completion %d sent its filter entry inline and waits on the stuck filter (stats %+v)", i, lay.Stats())
		}
		if st := lay.Stats(); st.FilterDropped > 0 {
			close(f.release)
			released = true
			return
		}
	}
	t.Fatalf("the write queue never filled: stats %+v", lay.Stats())
}
