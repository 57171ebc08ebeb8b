package storetest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// forever is the longest Duration: "keep it forever".
const forever = time.Duration(math.MaxInt64)

// farFuture is how late a forever lease or retention must end at least.
func farFuture() time.Time { return time.Now().Add(100 * 365 * 24 * time.Hour) }

// testForeverDurations: a lease or retention of math.MaxInt64 saturates
// (at dedup.MaxTime or later) instead of overflowing into the past, so the
// record is not born expired and the next delivery is not run again.
func testForeverDurations(t testing.TB, e *Env) {
	if e.Features.ManualClock {
		e.Advance(time.Hour) // a store that has been running a while
	}
	c := e.MustClaim(t, "lease", fpA, forever, dedup.Acquired)
	if !c.LeaseUntil.After(farFuture()) {
		t.Fatalf("a forever lease ends at %v", c.LeaseUntil)
	}
	p := e.MustClaim(t, "lease", fpA, longLease, dedup.InProgress)
	if !p.LeaseUntil.After(farFuture()) {
		t.Fatalf("the in-progress answer for a forever lease says it ends at %v", p.LeaseUntil)
	}
	e.MustComplete(t, c, []byte("kept"), forever)
	d := e.MustClaim(t, "lease", fpA, longLease, dedup.Duplicate)
	if string(d.Result) != "kept" {
		t.Fatalf("forever record result %q", d.Result)
	}
	if !d.ExpiresAt.IsZero() && !d.ExpiresAt.After(farFuture()) {
		t.Fatalf("a forever retention expires at %v", d.ExpiresAt)
	}
	if e.Features.Extend {
		c2 := e.MustClaim(t, "extended", fpA, longLease, dedup.Acquired)
		c3, err := e.Store.(dedup.Extender).Extend(context.Background(), c2, forever)
		if err != nil {
			t.Fatalf("Extend(forever): %v", err)
		}
		if !c3.LeaseUntil.After(farFuture()) {
			t.Fatalf("a lease extended forever ends at %v", c3.LeaseUntil)
		}
		e.MustClaim(t, "extended", fpA, longLease, dedup.InProgress)
	}
	if e.Features.ManualClock {
		e.Advance(1000 * 24 * time.Hour)
		e.MustClaim(t, "lease", fpA, longLease, dedup.Duplicate)
		if e.Features.Extend {
			e.MustClaim(t, "extended", fpA, longLease, dedup.InProgress)
		}
	}
}

// testBatchLockOrder: a batch completion and batch claims of the same keys
// run at once must not fail each other (a deadlock, when a store locks
// records in different orders). The keys are claimed one at a time in
// reverse order first, so that a store keeping them in insertion order
// holds them against key order.
func testBatchLockOrder(t testing.TB, e *Env) {
	bc := e.Store.(dedup.BatchClaimer)
	bk := e.Store.(dedup.BatchCompleter)
	ctx := context.Background()
	const rounds, n = 10, 40
	for round := range rounds {
		reqs := make([]dedup.ClaimRequest, n)
		for i := range reqs {
			reqs[i] = dedup.ClaimRequest{Key: e.Key(fmt.Sprintf("order-%02d-%03d", round, i))}
		}
		items := make([]dedup.Completion, n)
		for i := n - 1; i >= 0; i-- {
			c := e.MustClaim(t, reqs[i].Key.ID, "", longLease, dedup.Acquired)
			items[i] = dedup.Completion{Claim: c, Result: []byte("done")}
		}
		var wg sync.WaitGroup
		start := make(chan struct{})
		wg.Go(func() {
			<-start
			errs, err := bk.CompleteBatch(ctx, items, retention)
			if err != nil {
				t.Errorf("round %d: CompleteBatch beside ClaimBatch: %v", round, err)
				return
			}
			for i, err := range errs {
				if err != nil {
					t.Errorf("round %d: completion %d: %v", round, i, err)
				}
			}
		})
		for range 3 {
			wg.Go(func() {
				<-start
				cs, err := bc.ClaimBatch(ctx, reqs, longLease)
				if err != nil {
					t.Errorf("round %d: ClaimBatch beside CompleteBatch: %v", round, err)
					return
				}
				for i, c := range cs {
					if c.Outcome != dedup.InProgress && c.Outcome != dedup.Duplicate {
						t.Errorf("round %d: key %d: %v, want in progress or duplicate", round, i, c.Outcome)
					}
				}
			})
		}
		close(start)
		wg.Wait()
		if t.Failed() {
			return
		}
	}
}

// testCancelMidCall: a call whose context ends at some instant during it
// either did its work, or failed; a failure that says nothing was applied
// (SafeToRetry) must have left the key exactly as it was, and any failure
// is recoverable by the same token. This is what a composite store gets
// wrong when it cleans up a first step on the caller's context after the
// second step failed.
func testCancelMidCall(t testing.TB, e *Env) {
	bg := context.Background()
	rng := rand.New(rand.NewPCG(rand.Uint64(), 1))
	cancelled := func() (context.Context, func()) {
		ctx, cancel := context.WithCancel(bg)
		t := time.AfterFunc(time.Duration(rng.IntN(300))*time.Microsecond, cancel)
		return ctx, func() { t.Stop(); cancel() }
	}
	notApplied := func(err error) bool {
		var sr interface{ SafeToRetry() bool }
		return errors.As(err, &sr) && sr.SafeToRetry()
	}
	for i := range 60 {
		id := fmt.Sprint("cancel-", i)
		// Claim.
		ctx, stop := cancelled()
		c, err := e.Store.Claim(ctx, e.Key(id), fpA, longLease)
		stop()
		switch {
		case err == nil && c.Outcome == dedup.Acquired:
		case err == nil:
			t.Fatalf("claim %d of a new key: %v", i, c.Outcome)
		case notApplied(err):
			c = e.MustClaim(t, id, fpA, longLease, dedup.Acquired) // nothing may be left holding it
		default:
			continue // the claim may hold the key until its lease ends: allowed
		}
		// Complete or Release, cancelled at some instant.
		ctx, stop = cancelled()
		if i%2 == 0 {
			err = e.Store.Complete(ctx, c, []byte("r"), retention)
			stop()
			if err != nil {
				if notApplied(err) {
					e.MustClaim(t, id, fpA, longLease, dedup.InProgress)
				}
				if err := e.Store.Complete(bg, c, []byte("r"), retention); err != nil {
					t.Fatalf("completing %s again with its token after %v: %v", id, err, err)
				}
			}
			e.MustClaim(t, id, fpA, longLease, dedup.Duplicate)
			continue
		}
		err = e.Store.Release(ctx, c)
		stop()
		if err != nil {
			if notApplied(err) {
				e.MustClaim(t, id, fpA, longLease, dedup.InProgress)
			}
			if err := e.Store.Release(bg, c); err != nil && !errors.Is(err, dedup.ErrLeaseLost) {
				t.Fatalf("releasing %s again: %v", id, err)
			}
		}
		e.MustClaim(t, id, fpA, longLease, dedup.Acquired)
	}
}
