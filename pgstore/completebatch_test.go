package pgstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// TestCompleteBatchInOneStatement: 500 claims completed in one call, with
// every seventh token stale and every claim sent twice (the same key and
// token: the first occurrence's result is kept, both report success), on
// both layouts; the scope's retention window raises the records' expiry
// as Complete's does.
func TestCompleteBatchInOneStatement(t *testing.T) {
	forModes(t, func(t *testing.T, m mode) {
		s := openStore(t, m.opts...)
		ctx := context.Background()
		if err := s.SetRetention(ctx, key("").Scope, 48*time.Hour, 0); err != nil {
			t.Fatal(err)
		}
		const n = 500
		reqs := make([]dedup.ClaimRequest, n)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprint("k", i)), Fingerprint: fpA}
		}
		claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		stale := func(i int) bool { return i%7 == 3 }
		items := make([]dedup.Completion, 0, 2*n)
		for i, c := range claims {
			if stale(i) {
				c.Token = dedup.NewToken()
			}
			items = append(items, dedup.Completion{Claim: c, Result: []byte(fmt.Sprint("r", i))})
		}
		for _, c := range items[:n] {
			items = append(items, dedup.Completion{Claim: c.Claim, Result: []byte("repeat")})
		}
		errs, err := s.CompleteBatch(ctx, items, time.Hour)
		if err != nil || len(errs) != len(items) {
			t.Fatalf("CompleteBatch = %d results, %v", len(errs), err)
		}
		for i, err := range errs {
			if st := stale(i % n); st != errors.Is(err, dedup.ErrLeaseLost) || !st && err != nil {
				t.Fatalf("item %d: %v (stale %v)", i, err, st)
			}
		}
		again, err := s.ClaimBatch(ctx, reqs, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		for i, c := range again {
			switch {
			case stale(i) && c.Outcome != dedup.InProgress:
				t.Fatalf("key %d, completed with a stale token: %v", i, c.Outcome)
			case !stale(i) && (c.Outcome != dedup.Duplicate || string(c.Result) != fmt.Sprint("r", i)):
				t.Fatalf("key %d: %v %q, want a duplicate with r%d", i, c.Outcome, c.Result, i)
			case !stale(i) && time.Until(c.ExpiresAt) < 47*time.Hour:
				t.Fatalf("key %d expires at %v: the scope's 48h window did not apply", i, c.ExpiresAt)
			}
		}
	})
}

// TestCompleteBatchOverlapping: goroutines completing overlapping batches
// (the same keys, in other orders, each item with its own owner's token
// or a stale one) neither deadlock nor complete a key twice: every key
// ends completed with the result of the one batch that owned it.
func TestCompleteBatchOverlapping(t *testing.T) {
	s := openStore(t)
	ctx := context.Background()
	const keys, workers = 200, 8
	reqs := make([]dedup.ClaimRequest, keys)
	for i := range reqs {
		reqs[i] = dedup.ClaimRequest{Key: key(fmt.Sprint("o", i))}
	}
	claims, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// Worker w owns the keys i with i % workers == w and holds stale
	// tokens for the others, in an order of its own.
	var wg sync.WaitGroup
	okCount := make([]int, workers)
	for w := range workers {
		wg.Go(func() {
			items := make([]dedup.Completion, keys)
			for j := range keys {
				i := (j*7 + w*31) % keys
				c := claims[i]
				if i%workers != w {
					c.Token = dedup.NewToken()
				}
				items[j] = dedup.Completion{Claim: c, Result: []byte(fmt.Sprint("w", w))}
			}
			errs, err := s.CompleteBatch(ctx, items, time.Hour)
			if err != nil {
				t.Errorf("worker %d: %v", w, err)
				return
			}
			for _, err := range errs {
				if err == nil {
					okCount[w]++
				} else if !errors.Is(err, dedup.ErrLeaseLost) {
					t.Errorf("worker %d: %v", w, err)
				}
			}
		})
	}
	wg.Wait()
	for w, n := range okCount {
		if n != keys/workers {
			t.Errorf("worker %d completed %d keys, owns %d", w, n, keys/workers)
		}
	}
	again, err := s.ClaimBatch(ctx, reqs, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	for i, c := range again {
		if c.Outcome != dedup.Duplicate || string(c.Result) != fmt.Sprint("w", i%workers) {
			t.Fatalf("key %d: %v %q, want a duplicate of w%d", i, c.Outcome, c.Result, i%workers)
		}
	}
}
