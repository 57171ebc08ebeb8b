package dedup_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// cutStore is memstore whose first Complete ends the caller's context
// (a shutdown arriving while the completion is under way) and then
// answers as cut says: the store's call cut short before or after it
// wrote, or a passing refusal that sends the runner into a pause.
type cutStore struct {
	*memstore.Store
	cancel context.CancelFunc
	cut    string // "before", "after" or "transient"
	calls  atomic.Int32
}

func (s *cutStore) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	if s.calls.Add(1) > 1 {
		return s.Store.Complete(ctx, c, result, retention)
	}
	switch s.cut {
	case "after":
		if err := s.Store.Complete(ctx, c, result, retention); err != nil {
			return err
		}
	case "transient":
		s.cancel()
		return &dedup.StoreError{Store: "cut", Op: "complete", Err: errors.New("deadlock detected"), Transient: true}
	}
	s.cancel()
	return ctx.Err()
}

// A handler's success is recorded even when the caller's context ends
// while the completion runs: during the store's call (whether or not the
// call wrote) or in the pause before a try again. Before, the runner gave
// up with the context's error, the key stayed in progress, and after the
// lease a redelivery would take it over and apply the effect again.
func TestCompleteCutShortByCancelIsFinished(t *testing.T) {
	for _, cut := range []string{"before", "after", "transient"} {
		for _, hooked := range []bool{false, true} {
			name := cut
			if hooked {
				name += "/hooks"
			}
			t.Run(name, func(t *testing.T) {
				mem, _ := newMem(t)
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				st := &cutStore{Store: mem, cancel: cancel, cut: cut}
				opts := []dedup.RunnerOption{dedup.WithLease(time.Minute), dedup.WithCompleteAttempts(3)}
				if hooked {
					opts = append(opts, dedup.WithHooks(dedup.HookFunc(func(context.Context, any) {})))
				}
				r, err := dedup.NewRunner(st, opts...)
				if err != nil {
					t.Fatal(err)
				}
				key := dedup.Key{Scope: "pay", ID: "m1"}
				effects := 0
				res, err := r.Do(ctx, key, "", func(context.Context) ([]byte, error) {
					effects++
					return []byte("ok"), nil
				})
				if err != nil {
					t.Fatalf("Do: %v (the success was not recorded)", err)
				}
				if string(res.Result) != "ok" || effects != 1 {
					t.Fatalf("result %q, effects %d", res.Result, effects)
				}
				if ctx.Err() == nil {
					t.Fatal("the store did not end the caller's context")
				}
				c, err := mem.Claim(context.Background(), key, "", time.Minute)
				if err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != "ok" {
					t.Fatalf("after Do the key is %v %q (%v), want a duplicate with the result", c.Outcome, c.Result, err)
				}
				if n := st.calls.Load(); n != 2 {
					t.Fatalf("%d Complete calls, want 2", n)
				}
			})
		}
	}
}
