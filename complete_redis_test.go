package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/internal/redistest"
	"github.com/dedupkit/dedup/redisstore"
)

// firstTryStore is a Redis store whose Complete calls go through before,
// which sees each call (numbered from 1) and may answer it instead of
// Redis. It records the deadline of each call's context.
type firstTryStore struct {
	*redisstore.Store
	before func(ctx context.Context, n int, c dedup.Claim) (error, bool)

	mu        sync.Mutex
	deadlines []time.Time
}

func (s *firstTryStore) Complete(ctx context.Context, c dedup.Claim, result []byte, retention time.Duration) error {
	s.mu.Lock()
	d, _ := ctx.Deadline()
	s.deadlines = append(s.deadlines, d)
	n := len(s.deadlines)
	s.mu.Unlock()
	if s.before != nil {
		if err, answered := s.before(ctx, n, c); answered {
			return err
		}
	}
	return s.Store.Complete(ctx, c, result, retention)
}

func (s *firstTryStore) calls() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Time(nil), s.deadlines...)
}

var errPassing = &dedup.StoreError{Store: "test", Op: "complete", Err: errors.New("deadlock detected"), Transient: true}

// Runner.complete makes its first try before its loop of tries again
// (a9d4886). On a real Redis store, with and without hooks (without, Do
// takes its fast path), every way the first try can end keeps what the
// loop did: a passing refusal is tried again up to the attempts allowed,
// and no more; a try cut short by the caller's context is made again on a
// context detached from it and bounded by the finalize timeout; a lost
// lease is returned at once and leaves the new owner's claim alone; a
// store that hangs holds Do for one finalize timeout, not more.
func TestCompleteFirstTryOnRedis(t *testing.T) {
	const finalize = 200 * time.Millisecond
	for _, hooked := range []bool{false, true} {
		setup := func(t *testing.T, tries int, before func(ctx context.Context, n int, c dedup.Claim) (error, bool)) (*firstTryStore, *dedup.Runner) {
			t.Helper()
			st := &firstTryStore{Store: redistest.Store(t, fmt.Sprintf("firsttry:%s:", t.Name())), before: before}
			opts := []dedup.RunnerOption{dedup.WithLease(time.Minute), dedup.WithCompleteAttempts(tries), dedup.WithFinalizeTimeout(finalize)}
			if hooked {
				opts = append(opts, dedup.WithHooks(dedup.HookFunc(func(context.Context, any) {})))
			}
			r, err := dedup.NewRunner(st, opts...)
			if err != nil {
				t.Fatal(err)
			}
			return st, r
		}
		key := dedup.Key{Scope: "pay", ID: "m1"}
		outcome := func(t *testing.T, st *firstTryStore) dedup.Claim {
			t.Helper()
			c, err := st.Store.Claim(context.Background(), key, "", time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			return c
		}
		ok := func(context.Context) ([]byte, error) { return []byte("ok"), nil }
		name := func(s string) string {
			if hooked {
				return s + "/hooks"
			}
			return s
		}

		// Refused k times for a passing condition: k tries allowed end with
		// the refusal after exactly k calls; k+1 complete on the last.
		t.Run(name("passing"), func(t *testing.T) {
			const k = 3
			for _, tries := range []int{1, k, k + 1} {
				st, r := setup(t, tries, func(_ context.Context, n int, _ dedup.Claim) (error, bool) {
					return errPassing, n <= k
				})
				key.ID = fmt.Sprintf("m-%d", tries)
				_, err := r.Do(context.Background(), key, "", ok)
				calls := len(st.calls())
				if tries <= k {
					if !errors.Is(err, errPassing) || calls != tries {
						t.Fatalf("%d tries: Do %v after %d calls, want the refusal after %d", tries, err, calls, tries)
					}
					continue
				}
				if err != nil || calls != k+1 {
					t.Fatalf("%d tries: Do %v after %d calls, want success after %d", tries, err, calls, k+1)
				}
				if c := outcome(t, st); c.Outcome != dedup.Duplicate || string(c.Result) != "ok" {
					t.Fatalf("%d tries: key %v %q, want completed", tries, c.Outcome, c.Result)
				}
			}
			key.ID = "m1"
		})

		// The caller's context ends during the first try (Redis sees the
		// ended context): the try is made again, detached, and lands.
		for _, refuse := range []bool{false, true} {
			t.Run(name(fmt.Sprintf("cancelled/refused=%v", refuse)), func(t *testing.T) {
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				st, r := setup(t, 3, func(_ context.Context, n int, _ dedup.Claim) (error, bool) {
					if n == 1 {
						cancel()
						if refuse {
							return errPassing, true
						}
					}
					return nil, false
				})
				start := time.Now()
				res, err := r.Do(ctx, key, "", ok)
				if err != nil || string(res.Result) != "ok" {
					t.Fatalf("Do %q %v, want the success recorded", res.Result, err)
				}
				calls := st.calls()
				if len(calls) != 2 || !calls[0].IsZero() || calls[1].IsZero() || calls[1].Before(start) || calls[1].After(time.Now().Add(finalize)) {
					t.Fatalf("Complete calls under deadlines %v, want the caller's (none) then one finalize timeout's", calls)
				}
				if c := outcome(t, st); c.Outcome != dedup.Duplicate || string(c.Result) != "ok" {
					t.Fatalf("key %v %q, want completed", c.Outcome, c.Result)
				}
			})
		}

		// The lease is lost before the first try (released, and claimed by
		// another owner): the loss is returned at once, not tried again, and
		// the other owner keeps the key.
		t.Run(name("lost"), func(t *testing.T) {
			var st *firstTryStore
			st, r := setup(t, 3, func(ctx context.Context, n int, c dedup.Claim) (error, bool) {
				if n > 1 {
					return nil, false
				}
				if err := st.Store.Release(ctx, c); err != nil {
					return err, true
				}
				if o, err := st.Store.Claim(ctx, c.Key, "", time.Minute); err != nil || o.Outcome != dedup.Acquired {
					return fmt.Errorf("the other owner's claim: %v %v", o.Outcome, err), true
				}
				return nil, false
			})
			_, err := r.Do(context.Background(), key, "", ok)
			if !errors.Is(err, dedup.ErrLeaseLost) || len(st.calls()) != 1 {
				t.Fatalf("Do %v after %d calls, want the lost lease after 1", err, len(st.calls()))
			}
			if c := outcome(t, st); c.Outcome != dedup.InProgress {
				t.Fatalf("key %v, want the new owner's claim in progress", c.Outcome)
			}
		})

		// A store that hangs, and the caller's context ends while it does:
		// the detached try hangs too, and Do returns when the one finalize
		// timeout ends, every later try (none) on the same deadline.
		t.Run(name("hung"), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st, r := setup(t, 5, func(ctx context.Context, n int, _ dedup.Claim) (error, bool) {
				if n == 1 {
					cancel()
				}
				<-ctx.Done()
				return &dedup.StoreError{Store: "test", Op: "complete", Err: ctx.Err(), Transient: true}, true
			})
			if _, err := r.Do(ctx, key, "", ok); err == nil {
				t.Fatal("Do succeeded on a store that hangs")
			}
			calls := st.calls()
			for _, d := range calls[1:] {
				if !d.Equal(calls[1]) {
					t.Fatalf("Complete calls under deadlines %v, want one finalize timeout after the first", calls)
				}
			}
			if len(calls) < 2 || calls[1].IsZero() {
				t.Fatalf("Complete calls under deadlines %v, want a detached try", calls)
			}
		})
	}
}
