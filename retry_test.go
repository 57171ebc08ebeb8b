package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
)

// refusing is a memstore that refuses its first batchRefusals batch
// completions and its first refusals single completions with a deadlock,
// as PostgreSQL does (a transient StoreError: rolled back, try again), or
// with a plain store error when unknown is set.
type refusing struct {
	*memstore.Store
	batchRefusals, refusals int64
	unknown                 bool
	batchCalls, calls       atomic.Int64
}

func (r *refusing) refusal(op string) error {
	if r.unknown {
		return &dedup.StoreError{Store: "test", Op: op, Err: errors.New("connection reset")}
	}
	return &dedup.StoreError{Store: "test", Op: op, Err: errors.New("deadlock detected (SQLSTATE 40P01)"), NotApplied: true, Transient: true}
}

func (r *refusing) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	if r.batchCalls.Add(1) <= r.batchRefusals {
		return nil, r.refusal("complete batch")
	}
	return r.Store.CompleteBatch(ctx, items, ret)
}

func (r *refusing) Complete(ctx context.Context, c dedup.Claim, res []byte, ret time.Duration) error {
	if r.calls.Add(1) <= r.refusals {
		return r.refusal("complete")
	}
	return r.Store.Complete(ctx, c, res, ret)
}

// batchOf returns n requests and a handler that counts its runs per key.
func batchOf(n int) ([]dedup.ClaimRequest, dedup.BatchHandler, *[]atomic.Int64) {
	reqs := make([]dedup.ClaimRequest, n)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: k(fmt.Sprint("r", i))}
	}
	runs := make([]atomic.Int64, n)
	return reqs, func(_ context.Context, i int, _ dedup.Claim) ([]byte, error) {
		runs[i].Add(1)
		return []byte(fmt.Sprint("ok", i)), nil
	}, &runs
}

// checkCompleted asserts that every request ran once and is now a
// duplicate with its result.
func checkCompleted(t *testing.T, s dedup.Store, reqs []dedup.ClaimRequest, runs *[]atomic.Int64, errs []error) {
	t.Helper()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if n := (*runs)[i].Load(); n != 1 {
			t.Fatalf("request %d ran %d times", i, n)
		}
		c, err := s.Claim(context.Background(), reqs[i].Key, "", time.Minute)
		if err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != fmt.Sprint("ok", i) {
			t.Fatalf("request %d after the batch: %v %q %v, want a duplicate", i, c.Outcome, c.Result, err)
		}
	}
}

// TestDoBatchRetriesTransientCompletion: a batch completion refused by a
// deadlock is tried again, and the effects that ran are completed, not
// left in progress to be taken over and run again after their lease.
func TestDoBatchRetriesTransientCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem, _ := newMem(t)
		s := &refusing{Store: mem, batchRefusals: 2}
		reqs, h, runs := batchOf(8)
		_, errs := newRunner(t, s).DoBatch(context.Background(), reqs, h)
		checkCompleted(t, mem, reqs, runs, errs)
		if got := s.batchCalls.Load(); got != 3 {
			t.Fatalf("CompleteBatch called %d times, want 3 (two refusals, then success)", got)
		}
		if got := s.calls.Load(); got != 0 {
			t.Fatalf("Complete called %d times, want 0", got)
		}
	})
}

// TestDoBatchFallsBackToSingleCompletions: a batch completion refused on
// every try is completed one claim at a time (one lock each: no deadlock
// possible), each single completion retried too.
func TestDoBatchFallsBackToSingleCompletions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem, _ := newMem(t)
		s := &refusing{Store: mem, batchRefusals: 1 << 30, refusals: 2}
		reqs, h, runs := batchOf(8)
		_, errs := newRunner(t, s, dedup.WithCompleteAttempts(3)).DoBatch(context.Background(), reqs, h)
		checkCompleted(t, mem, reqs, runs, errs)
		if got := s.batchCalls.Load(); got != 3 {
			t.Fatalf("CompleteBatch called %d times, want 3 (the attempts)", got)
		}
		if got := s.calls.Load(); got != 8+2 {
			t.Fatalf("Complete called %d times, want 10 (8 claims, two of the calls refused)", got)
		}
	})
}

// TestDoBatchDoesNotRetryUnknownOutcome: a store error that is not
// transient (the write may or may not have happened) is not retried: it
// is returned, and the lease decides.
func TestDoBatchDoesNotRetryUnknownOutcome(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem, _ := newMem(t)
		s := &refusing{Store: mem, batchRefusals: 1, unknown: true}
		reqs, h, _ := batchOf(4)
		_, errs := newRunner(t, s).DoBatch(context.Background(), reqs, h)
		for i, err := range errs {
			if !dedup.IsStoreError(err) || dedup.IsTransient(err) {
				t.Fatalf("request %d: %v, want the non-transient store error", i, err)
			}
		}
		if got := s.batchCalls.Load(); got != 1 {
			t.Fatalf("CompleteBatch called %d times, want 1", got)
		}
	})
}

// TestDoRetriesTransientCompletion: the same for a single Do.
func TestDoRetriesTransientCompletion(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem, _ := newMem(t)
		s := &refusing{Store: mem, refusals: 3}
		var runs atomic.Int64
		res, err := newRunner(t, s).Do(context.Background(), key, "", func(context.Context) ([]byte, error) {
			runs.Add(1)
			return []byte("done"), nil
		})
		if err != nil || string(res.Result) != "done" || runs.Load() != 1 {
			t.Fatalf("Do = %+v, %v after %d runs", res, err, runs.Load())
		}
		if got := s.calls.Load(); got != 4 {
			t.Fatalf("Complete called %d times, want 4", got)
		}
		if c, _ := mem.Claim(context.Background(), key, "", time.Minute); c.Outcome != dedup.Duplicate {
			t.Fatalf("key after Do: %v, want a duplicate", c.Outcome)
		}
		// Past the attempts, the refusal is returned.
		s2 := &refusing{Store: mem, refusals: 100}
		_, err = newRunner(t, s2, dedup.WithCompleteAttempts(2)).Do(context.Background(), k("other"), "", func(context.Context) ([]byte, error) { return nil, nil })
		if !dedup.IsTransient(err) || s2.calls.Load() != 2 {
			t.Fatalf("after 2 refusals: %v (%d calls), want the transient error after 2 calls", err, s2.calls.Load())
		}
	})
}

func TestWithCompleteAttemptsValidated(t *testing.T) {
	mem, _ := newMem(t)
	for _, n := range []int{0, -1, 101} {
		if _, err := dedup.NewRunner(mem, dedup.WithCompleteAttempts(n)); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("WithCompleteAttempts(%d): %v, want ErrInvalidArgument", n, err)
		}
	}
}
