package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// hungStore is memstore whose Complete hangs until its context ends (a
// store that stopped answering) and whose CompleteBatch refuses for a
// passing condition, so that a batch falls back to one completion at a
// time. It records the deadline of every Complete's context.
type hungStore struct {
	*memstore.Store
	mu        sync.Mutex
	deadlines []time.Time
}

func (s *hungStore) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	d, ok := ctx.Deadline()
	if !ok {
		d = time.Time{}
	}
	s.mu.Lock()
	s.deadlines = append(s.deadlines, d)
	s.mu.Unlock()
	<-ctx.Done()
	return ctx.Err()
}

func (s *hungStore) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	return nil, &dedup.StoreError{Store: "hung", Op: "complete batch", Err: errors.New("deadlock detected"), Transient: true}
}

// distinct returns the distinct deadlines the Complete calls ran under.
func (s *hungStore) distinct() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []time.Time
	for _, d := range s.deadlines {
		seen := false
		for _, o := range out {
			seen = seen || o.Equal(d)
		}
		if !seen {
			out = append(out, d)
		}
	}
	return out
}

// Once the caller's context has ended, Complete runs on a context detached
// from it and bounded by the finalize timeout, once: a completion already
// on that context is not detached again when the timeout ends it. Before,
// complete took the ended finalize context for the caller's and made a
// new one, so a store that hangs held Do for twice the finalize timeout,
// and a batch that fell back to one completion at a time for a finalize
// timeout per item (a shutdown held for hours by a batch of hundreds).
func TestCompleteOnFinalizeContextIsNotDetachedAgain(t *testing.T) {
	for _, mode := range []string{"do", "do/hooks", "batch"} {
		t.Run(mode, func(t *testing.T) {
			mem, _ := newMem(t)
			st := &hungStore{Store: mem}
			opts := []dedup.RunnerOption{dedup.WithLease(time.Minute), dedup.WithCompleteAttempts(2),
				dedup.WithFinalizeTimeout(20 * time.Millisecond)}
			if mode == "do/hooks" {
				opts = append(opts, dedup.WithHooks(dedup.HookFunc(func(context.Context, any) {})))
			}
			r, err := dedup.NewRunner(st, opts...)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			if mode == "batch" {
				reqs := make([]dedup.ClaimRequest, 5)
				for i := range reqs {
					reqs[i].Key = dedup.Key{Scope: "pay", ID: fmt.Sprint("m", i)}
				}
				// The batch completes on a finalize context whether or not
				// its own ends.
				_, errs := r.DoBatch(ctx, reqs, func(context.Context, int, dedup.Claim) ([]byte, error) {
					return []byte("ok"), nil
				})
				for i, err := range errs {
					if err == nil {
						t.Fatalf("item %d: no error from a store that never completed", i)
					}
				}
			} else {
				_, err := r.Do(ctx, dedup.Key{Scope: "pay", ID: "m1"}, "", func(context.Context) ([]byte, error) {
					cancel() // a shutdown while the handler runs
					return []byte("ok"), nil
				})
				if err == nil {
					t.Fatal("Do: no error from a store that never completed")
				}
			}
			if d := st.distinct(); len(d) != 1 {
				t.Fatalf("Complete ran under %d finalize contexts (deadlines %v), want one", len(d), d)
			}
		})
	}
}
