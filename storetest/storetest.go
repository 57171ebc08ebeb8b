package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
)

// Features declares what a store can do beyond the base contract.
type Features struct {
	// ManualClock: the store reads the *Clock given to the factory, so the
	// suite moves time instead of sleeping.
	ManualClock bool
	// Extend: the store implements dedup.Extender.
	Extend bool
	// BatchClaim: the store implements dedup.BatchClaimer.
	BatchClaim bool
	// BatchComplete: the store implements dedup.BatchCompleter.
	BatchComplete bool
	// Sweep: the store implements dedup.Sweeper.
	Sweep bool
}

// NewStore returns a fresh, open store for one test. It registers its own
// cleanup (t.Cleanup) to close the store; closing twice must not panic.
type NewStore func(t testing.TB, clock *Clock) dedup.Store

// A Test is one conformance check.
type Test struct {
	Name string
	// Needs names the feature the test requires, or "".
	Needs string
	Fn    func(t testing.TB, e *Env)
}

// Env is what a test gets: its own store, clock and key scope.
type Env struct {
	Store    dedup.Store
	Clock    *Clock
	Features Features
	Scope    string
}

// Leases and waits used by the suite. Short ones are real durations for
// stores on a server clock, so keep them small but far above scheduling
// noise.
const (
	longLease  = time.Minute
	shortLease = 200 * time.Millisecond
	pastShort  = 450 * time.Millisecond
	retention  = time.Hour
)

// Run runs every test in [Tests] against stores made by newStore.
func Run(t *testing.T, newStore NewStore, f Features) {
	t.Helper()
	for _, tc := range Tests {
		t.Run(tc.Name, func(t *testing.T) {
			if tc.Needs != "" && !f.has(tc.Needs) {
				t.Skipf("store does not declare feature %s", tc.Needs)
			}
			t.Parallel()
			tc.Fn(t, NewEnv(t, newStore, f, tc.Name))
		})
	}
}

// NewEnv makes the environment of one test.
func NewEnv(t testing.TB, newStore NewStore, f Features, name string) *Env {
	clock := NewClock()
	s := newStore(t, clock)
	if s == nil {
		t.Fatal("storetest: the factory returned a nil store")
	}
	return &Env{Store: s, Clock: clock, Features: f,
		Scope: fmt.Sprintf("storetest/%s/%016x", name, rand.Uint64())}
}

func (f Features) has(name string) bool {
	if a, b, ok := strings.Cut(name, "+"); ok {
		return f.has(a) && f.has(b)
	}
	switch name {
	case "Extend":
		return f.Extend
	case "BatchClaim":
		return f.BatchClaim
	case "BatchComplete":
		return f.BatchComplete
	case "Sweep":
		return f.Sweep
	}
	return false
}

// Advance moves the store's time forward by d: the manual clock when the
// store has one, a sleep otherwise.
func (e *Env) Advance(d time.Duration) {
	if e.Features.ManualClock {
		e.Clock.Advance(d)
		return
	}
	time.Sleep(d)
}

// Key returns the key id in the test's own scope.
func (e *Env) Key(id string) dedup.Key { return dedup.Key{Scope: e.Scope, ID: id} }

// MustClaim claims and fails the test on an error or another outcome.
func (e *Env) MustClaim(t testing.TB, id string, fp dedup.Fingerprint, lease time.Duration, want dedup.Outcome) dedup.Claim {
	t.Helper()
	c, err := e.Store.Claim(context.Background(), e.Key(id), fp, lease)
	if err != nil {
		t.Fatalf("Claim(%q): unexpected error %v", id, err)
	}
	if c.Outcome != want {
		t.Fatalf("Claim(%q) = %v, want %v", id, c.Outcome, want)
	}
	if c.Key != e.Key(id) {
		t.Fatalf("Claim(%q) returned key %v", id, c.Key)
	}
	return c
}

// MustComplete completes c and fails the test on an error.
func (e *Env) MustComplete(t testing.TB, c dedup.Claim, result []byte, ret time.Duration) {
	t.Helper()
	if err := e.Store.Complete(context.Background(), c, result, ret); err != nil {
		t.Fatalf("Complete(%v): %v", c.Key, err)
	}
}

func wantErr(t testing.TB, what string, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: error %v, want %v", what, err, target)
	}
}

const (
	fpA = dedup.Fingerprint("sha256:aaaa")
	fpB = dedup.Fingerprint("sha256:bbbb")
)

// Tests is the suite, one entry per rule of the contract.
var Tests = []Test{
	{Name: "AbsentIsAcquired", Fn: testAbsentIsAcquired},
	{Name: "SequentialDuplicate", Fn: testSequentialDuplicate},
	{Name: "ConcurrentClaimOneKey", Fn: testConcurrentClaimOneKey},
	{Name: "ConcurrentRunOnce", Fn: testConcurrentRunOnce},
	{Name: "LiveLeaseIsInProgress", Fn: testLiveLeaseIsInProgress},
	{Name: "LiveLeaseOtherFingerprint", Fn: testLiveLeaseOtherFingerprint},
	{Name: "ExpiredLeaseTakeover", Fn: testExpiredLeaseTakeover},
	{Name: "ConcurrentTakeover", Fn: testConcurrentTakeover},
	{Name: "ExpiredLeaseOtherFingerprint", Fn: testExpiredLeaseOtherFingerprint},
	{Name: "LateCompleteBeforeTakeover", Fn: testLateCompleteBeforeTakeover},
	{Name: "CompletedOtherFingerprint", Fn: testCompletedOtherFingerprint},
	{Name: "EmptyFingerprintMatchesAny", Fn: testEmptyFingerprintMatchesAny},
	{Name: "RetentionExpiry", Fn: testRetentionExpiry},
	{Name: "CompleteTwiceSameToken", Fn: testCompleteTwiceSameToken},
	{Name: "ReleaseThenReclaim", Fn: testReleaseThenReclaim},
	{Name: "ReleaseKeepsCompleted", Fn: testReleaseKeepsCompleted},
	{Name: "ForeignTokenChangesNothing", Fn: testForeignTokenChangesNothing},
	{Name: "CompleteMissingRecord", Fn: testCompleteMissingRecord},
	{Name: "FailedRunIsNotLost", Fn: testFailedRunIsNotLost},
	{Name: "CancelledContext", Fn: testCancelledContext},
	{Name: "InvalidArguments", Fn: testInvalidArguments},
	{Name: "ScopesAreIndependent", Fn: testScopesAreIndependent},
	{Name: "ResultIsCopied", Fn: testResultIsCopied},
	{Name: "LargeResultAndUnicodeKey", Fn: testLargeResultAndUnicodeKey},
	{Name: "ManyKeysParallel", Fn: testManyKeysParallel},
	{Name: "UseAfterClose", Fn: testUseAfterClose},
	{Name: "Extend", Needs: "Extend", Fn: testExtend},
	{Name: "BatchClaim", Needs: "BatchClaim", Fn: testBatchClaim},
	{Name: "BatchComplete", Needs: "BatchComplete", Fn: testBatchComplete},
	{Name: "Sweep", Needs: "Sweep", Fn: testSweep},
	{Name: "ForeverDurations", Fn: testForeverDurations},
	{Name: "CancelMidCall", Fn: testCancelMidCall},
	{Name: "Linearizable", Fn: testLinearizable},
	{Name: "BatchLockOrder", Needs: "BatchClaim+BatchComplete", Fn: testBatchLockOrder},
}

func testAbsentIsAcquired(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	if c.Token.IsZero() || c.Attempt != 1 || c.TakenOver || c.LeaseUntil.IsZero() {
		t.Fatalf("first claim = %+v: want a token, attempt 1, no take-over, a lease end", c)
	}
	if c.Err() != nil {
		t.Fatalf("acquired claim Err() = %v", c.Err())
	}
}

func testSequentialDuplicate(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, []byte("receipt-1"), retention)
	for i := range 3 {
		d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate)
		if string(d.Result) != "receipt-1" {
			t.Fatalf("duplicate %d result = %q, want the stored %q", i, d.Result, "receipt-1")
		}
		if d.Err() != nil || !d.Token.IsZero() {
			t.Fatalf("duplicate claim must carry no token and no error: %+v", d)
		}
	}
	// A nil result is stored as empty, not as a failure.
	c2 := e.MustClaim(t, "m2", "", longLease, dedup.Acquired)
	e.MustComplete(t, c2, nil, retention)
	if d := e.MustClaim(t, "m2", "", longLease, dedup.Duplicate); len(d.Result) != 0 {
		t.Fatalf("nil result came back as %q", d.Result)
	}
}

// testConcurrentClaimOneKey: N goroutines claim one key at once; exactly
// one may acquire, and so exactly one effect happens.
func testConcurrentClaimOneKey(t testing.TB, e *Env) {
	const n = 64
	var acquired, inProgress, effects atomic.Int32
	var winner atomic.Pointer[dedup.Claim]
	var start, done sync.WaitGroup
	start.Add(1)
	for range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			c, err := e.Store.Claim(context.Background(), e.Key("hot"), fpA, longLease)
			if err != nil {
				t.Errorf("concurrent Claim: %v", err)
				return
			}
			switch c.Outcome {
			case dedup.Acquired:
				acquired.Add(1)
				effects.Add(1)
				winner.Store(&c)
			case dedup.InProgress:
				inProgress.Add(1)
			default:
				t.Errorf("concurrent Claim = %v, want acquired or in progress", c.Outcome)
			}
		}()
	}
	start.Done()
	done.Wait()
	if acquired.Load() != 1 || effects.Load() != 1 || inProgress.Load() != n-1 {
		t.Fatalf("%d goroutines on one key: %d acquired, %d in progress, %d effects; want 1, %d, 1",
			n, acquired.Load(), inProgress.Load(), effects.Load(), n-1)
	}
	e.MustComplete(t, *winner.Load(), []byte("once"), retention)
	var dups atomic.Int32
	for range n {
		done.Add(1)
		go func() {
			defer done.Done()
			c, err := e.Store.Claim(context.Background(), e.Key("hot"), fpA, longLease)
			if err == nil && c.Outcome == dedup.Duplicate && string(c.Result) == "once" {
				dups.Add(1)
			}
		}()
	}
	done.Wait()
	if dups.Load() != n {
		t.Fatalf("after completion %d of %d claims were duplicates with the stored result", dups.Load(), n)
	}
}

// testConcurrentRunOnce: N goroutines deliver one message through the
// Runner, retrying while it is in progress, until each has an answer. The
// handler must run exactly once and every goroutine must see its result.
func testConcurrentRunOnce(t testing.TB, e *Env) {
	const n = 64
	r, err := dedup.NewRunner(e.Store, dedup.WithLease(longLease), dedup.WithRetention(retention))
	if err != nil {
		t.Fatal(err)
	}
	var effects, fresh, dups atomic.Int32
	var start, done sync.WaitGroup
	start.Add(1)
	for range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			for try := 0; ; try++ {
				res, err := r.Do(context.Background(), e.Key("pay-1"), fpA, func(context.Context) ([]byte, error) {
					effects.Add(1)
					time.Sleep(5 * time.Millisecond) // hold the lease while others arrive
					return []byte("charged"), nil
				})
				switch {
				case errors.Is(err, dedup.ErrInProgress) && try < 1000:
					time.Sleep(2 * time.Millisecond)
					continue
				case err != nil:
					t.Errorf("Do: %v", err)
				case string(res.Result) != "charged":
					t.Errorf("Do result = %q, want %q", res.Result, "charged")
				case res.Duplicate:
					dups.Add(1)
				default:
					fresh.Add(1)
				}
				return
			}
		}()
	}
	start.Done()
	done.Wait()
	if effects.Load() != 1 || fresh.Load() != 1 || dups.Load() != n-1 {
		t.Fatalf("%d deliveries of one message: %d effects, %d applied, %d duplicates; want 1, 1, %d",
			n, effects.Load(), fresh.Load(), dups.Load(), n-1)
	}
}

func testLiveLeaseIsInProgress(t testing.TB, e *Env) {
	start := time.Now()
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	if e.Features.ManualClock {
		e.Advance(time.Second) // a new lease would now end a second later
	}
	p := e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress)
	// A store on a server clock reports lease ends read on the client's
	// clock around each round trip, so the two may differ by up to the
	// time the two calls took (measured, not a fixed threshold: a loaded
	// machine stretches it), plus the stores' millisecond rounding. A new
	// lease instead of the owner's would differ by about the time between
	// the calls only if the calls were slower than longLease.
	if d, took := p.LeaseUntil.Sub(c.LeaseUntil).Abs(), time.Since(start); d > took+2*time.Millisecond {
		t.Fatalf("in-progress LeaseUntil %v, owner's %v (%v apart; the calls took %v): must report the owner's lease end",
			p.LeaseUntil, c.LeaseUntil, d, took)
	}
	if !p.Token.IsZero() || p.Attempt != 1 {
		t.Fatalf("in-progress claim = %+v: want no token, attempt 1", p)
	}
	var ip *dedup.InProgressError
	if err := p.Err(); !errors.Is(err, dedup.ErrInProgress) || !errors.As(err, &ip) {
		t.Fatalf("in-progress Err() = %v", err)
	}
	// The owner still owns it.
	e.MustComplete(t, c, []byte("ok"), retention)
}

func testLiveLeaseOtherFingerprint(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	m := e.MustClaim(t, "m1", fpB, longLease, dedup.Mismatch)
	if !errors.Is(m.Err(), dedup.ErrFingerprintMismatch) || m.Result != nil || !m.Token.IsZero() {
		t.Fatalf("mismatch claim = %+v, Err %v", m, m.Err())
	}
	e.MustComplete(t, c, []byte("a"), retention) // the original owner is untouched
}

func testExpiredLeaseTakeover(t testing.TB, e *Env) {
	old := e.MustClaim(t, "m1", fpA, shortLease, dedup.Acquired)
	e.Advance(pastShort)
	nw := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	if nw.Attempt != 2 || !nw.TakenOver || nw.Token == old.Token {
		t.Fatalf("take-over claim = %+v: want attempt 2, TakenOver, a new token", nw)
	}
	wantErr(t, "stale owner Complete", e.Store.Complete(context.Background(), old, []byte("stale"), retention), dedup.ErrLeaseLost)
	wantErr(t, "stale owner Release", e.Store.Release(context.Background(), old), dedup.ErrLeaseLost)
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress) // the new owner still holds it
	e.MustComplete(t, nw, []byte("fresh"), retention)
	if d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate); string(d.Result) != "fresh" {
		t.Fatalf("after take-over the stored result is %q, want the new owner's %q", d.Result, "fresh")
	}
}

func testConcurrentTakeover(t testing.TB, e *Env) {
	e.MustClaim(t, "m1", fpA, shortLease, dedup.Acquired)
	e.Advance(pastShort)
	const n = 32
	var acquired atomic.Int32
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := e.Store.Claim(context.Background(), e.Key("m1"), fpA, longLease)
			if err != nil {
				t.Errorf("Claim: %v", err)
				return
			}
			if c.Outcome == dedup.Acquired {
				acquired.Add(1)
				if c.Attempt != 2 {
					t.Errorf("take-over attempt = %d, want 2", c.Attempt)
				}
			} else if c.Outcome != dedup.InProgress {
				t.Errorf("Claim = %v, want acquired or in progress", c.Outcome)
			}
		}()
	}
	wg.Wait()
	if acquired.Load() != 1 {
		t.Fatalf("%d goroutines took over one expired lease: %d acquired, want 1", n, acquired.Load())
	}
}

func testExpiredLeaseOtherFingerprint(t testing.TB, e *Env) {
	e.MustClaim(t, "m1", fpA, shortLease, dedup.Acquired)
	e.Advance(pastShort)
	e.MustClaim(t, "m1", fpB, longLease, dedup.Mismatch)
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired) // the original request may still take over
	if c.Attempt != 2 {
		t.Fatalf("take-over after a mismatch: attempt %d, want 2", c.Attempt)
	}
}

func testLateCompleteBeforeTakeover(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, shortLease, dedup.Acquired)
	e.Advance(pastShort)
	e.MustComplete(t, c, []byte("late"), retention) // ran out, nobody took over: still ours
	if d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate); string(d.Result) != "late" {
		t.Fatalf("late completion stored %q", d.Result)
	}
}

func testCompletedOtherFingerprint(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, []byte("for-a"), retention)
	m := e.MustClaim(t, "m1", fpB, longLease, dedup.Mismatch)
	if m.Result != nil {
		t.Fatalf("a mismatch must not return the stored result, got %q", m.Result)
	}
	if d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate); string(d.Result) != "for-a" {
		t.Fatalf("the mismatch changed the record: result %q", d.Result)
	}
}

func testEmptyFingerprintMatchesAny(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", "", longLease, dedup.Acquired)
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress)
	e.MustComplete(t, c, []byte("x"), retention)
	e.MustClaim(t, "m1", fpB, longLease, dedup.Duplicate)
	c2 := e.MustClaim(t, "m2", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c2, []byte("y"), retention)
	e.MustClaim(t, "m2", "", longLease, dedup.Duplicate)
}

func testRetentionExpiry(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, []byte("old"), shortLease)
	e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate)
	e.Advance(pastShort)
	n := e.MustClaim(t, "m1", fpB, longLease, dedup.Acquired) // expired: any fingerprint
	if n.Attempt != 1 || n.TakenOver || len(n.Result) != 0 {
		t.Fatalf("claim after retention = %+v: want a fresh attempt 1", n)
	}
	wantErr(t, "Complete with the expired record's token", e.Store.Complete(context.Background(), c, nil, retention), dedup.ErrLeaseLost)
}

func testCompleteTwiceSameToken(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, []byte("first"), retention)
	e.MustComplete(t, c, []byte("second"), retention)
	if d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate); string(d.Result) != "first" {
		t.Fatalf("a second Complete changed the result to %q", d.Result)
	}
}

func testReleaseThenReclaim(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	if err := e.Store.Release(context.Background(), c); err != nil {
		t.Fatalf("Release: %v", err)
	}
	n := e.MustClaim(t, "m1", fpB, longLease, dedup.Acquired)
	if n.Attempt != 1 || n.Token == c.Token {
		t.Fatalf("claim after release = %+v: want attempt 1 with a new token", n)
	}
	wantErr(t, "Complete with the released token", e.Store.Complete(context.Background(), c, nil, retention), dedup.ErrLeaseLost)
	wantErr(t, "Release twice", e.Store.Release(context.Background(), c), dedup.ErrLeaseLost)
}

func testReleaseKeepsCompleted(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, []byte("done"), retention)
	wantErr(t, "Release after Complete", e.Store.Release(context.Background(), c), dedup.ErrLeaseLost)
	e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate)
}

func testForeignTokenChangesNothing(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	forged := c
	forged.Token = dedup.NewToken()
	wantErr(t, "Complete with a foreign token", e.Store.Complete(context.Background(), forged, nil, retention), dedup.ErrLeaseLost)
	wantErr(t, "Release with a foreign token", e.Store.Release(context.Background(), forged), dedup.ErrLeaseLost)
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress)
	e.MustComplete(t, c, nil, retention)
}

func testCompleteMissingRecord(t testing.TB, e *Env) {
	forged := dedup.Claim{Key: e.Key("ghost"), Outcome: dedup.Acquired, Token: dedup.NewToken(), Attempt: 1}
	wantErr(t, "Complete of an absent record", e.Store.Complete(context.Background(), forged, nil, retention), dedup.ErrLeaseLost)
	wantErr(t, "Release of an absent record", e.Store.Release(context.Background(), forged), dedup.ErrLeaseLost)
	e.MustClaim(t, "ghost", fpA, longLease, dedup.Acquired) // nothing was created
}

// testFailedRunIsNotLost is the bug of "SET NX, then process": a handler
// that fails after the claim must leave the key claimable, so the
// redelivery runs it again.
func testFailedRunIsNotLost(t testing.TB, e *Env) {
	r, err := dedup.NewRunner(e.Store, dedup.WithLease(longLease), dedup.WithRetention(retention))
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("downstream unavailable")
	runs, effects := 0, 0
	h := func(context.Context) ([]byte, error) {
		runs++
		if runs == 1 {
			return nil, boom
		}
		effects++
		return []byte("ok"), nil
	}
	if _, err := r.Do(context.Background(), e.Key("m1"), fpA, h); !errors.Is(err, boom) {
		t.Fatalf("first delivery: error %v, want the handler's", err)
	}
	res, err := r.Do(context.Background(), e.Key("m1"), fpA, h)
	if err != nil || res.Duplicate {
		t.Fatalf("redelivery after a failure: %+v, %v; want the handler to run again", res, err)
	}
	res, err = r.Do(context.Background(), e.Key("m1"), fpA, h)
	if err != nil || !res.Duplicate || string(res.Result) != "ok" {
		t.Fatalf("third delivery: %+v, %v; want a duplicate with the result", res, err)
	}
	if runs != 2 || effects != 1 {
		t.Fatalf("handler ran %d times with %d effects; want 2 runs, 1 effect", runs, effects)
	}
}

func testCancelledContext(t testing.TB, e *Env) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	c, err := e.Store.Claim(ctx, e.Key("m1"), fpA, longLease)
	if err == nil || !errors.Is(err, context.Canceled) || !dedup.IsStoreError(err) {
		t.Fatalf("Claim with a cancelled context = %v, %v; want a store error wrapping context.Canceled", c.Outcome, err)
	}
	if c.Outcome == dedup.Acquired || c.Outcome == dedup.Duplicate {
		t.Fatalf("a failed Claim reported %v: fail closed", c.Outcome)
	}
	own := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired) // nothing was written
	err = e.Store.Complete(ctx, own, []byte("x"), retention)
	if !errors.Is(err, context.Canceled) || !dedup.IsStoreError(err) {
		t.Fatalf("Complete with a cancelled context = %v", err)
	}
	err = e.Store.Release(ctx, own)
	if !errors.Is(err, context.Canceled) || !dedup.IsStoreError(err) {
		t.Fatalf("Release with a cancelled context = %v", err)
	}
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress) // neither completed nor released
	e.MustComplete(t, own, nil, retention)
}

func testInvalidArguments(t testing.TB, e *Env) {
	ctx := context.Background()
	bad := map[string]dedup.Key{
		"empty scope":       {Scope: "", ID: "x"},
		"empty id":          {Scope: e.Scope, ID: ""},
		"oversized id":      {Scope: e.Scope, ID: strings.Repeat("x", dedup.MaxIDBytes+1)},
		"oversized scope":   {Scope: strings.Repeat("s", dedup.MaxScopeBytes+1), ID: "x"},
		"invalid UTF-8":     {Scope: e.Scope, ID: "ab\xffcd"},
		"newline":           {Scope: e.Scope, ID: "a\nb"},
		"NUL":               {Scope: e.Scope, ID: "a\x00b"},
		"DEL":               {Scope: e.Scope, ID: "a\x7fb"},
		"C1 control":        {Scope: e.Scope, ID: "a\u0085b"},
		"control in scope":  {Scope: "t\tenant", ID: "x"},
		"truncated rune id": {Scope: e.Scope, ID: "\xe2\x82"},
	}
	for name, k := range bad {
		if _, err := e.Store.Claim(ctx, k, fpA, longLease); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("Claim with %s: error %v, want ErrInvalidArgument", name, err)
		}
	}
	good := e.Key("m1")
	for _, lease := range []time.Duration{0, -time.Second} {
		if _, err := e.Store.Claim(ctx, good, fpA, lease); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("Claim with lease %v: error %v, want ErrInvalidArgument", lease, err)
		}
	}
	long := dedup.Fingerprint(strings.Repeat("f", dedup.MaxFingerprintBytes+1))
	if _, err := e.Store.Claim(ctx, good, long, longLease); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Claim with an oversized fingerprint: error %v", err)
	}
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired) // none of the above wrote anything
	if err := e.Store.Complete(ctx, c, nil, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Complete with zero retention: error %v", err)
	}
	notOwned := dedup.Claim{Key: good, Outcome: dedup.Duplicate}
	if err := e.Store.Complete(ctx, notOwned, nil, retention); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Complete of a claim that was not acquired: error %v", err)
	}
	if err := e.Store.Release(ctx, notOwned); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Release of a claim that was not acquired: error %v", err)
	}
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress)
	// The limits themselves are accepted.
	edge := strings.Repeat("é", dedup.MaxIDBytes/2)
	ec := e.MustClaim(t, edge, fpA, longLease, dedup.Acquired)
	e.MustComplete(t, ec, nil, retention)
}

func testScopesAreIndependent(t testing.TB, e *Env) {
	a := dedup.Key{Scope: e.Scope + "/tenant-a", ID: "same-id"}
	b := dedup.Key{Scope: e.Scope + "/tenant-b", ID: "same-id"}
	ca, err := e.Store.Claim(context.Background(), a, fpA, longLease)
	if err != nil || ca.Outcome != dedup.Acquired {
		t.Fatalf("tenant a: %v, %v", ca.Outcome, err)
	}
	e.MustComplete(t, ca, []byte("secret-of-a"), retention)
	cb, err := e.Store.Claim(context.Background(), b, fpB, longLease)
	if err != nil || cb.Outcome != dedup.Acquired {
		t.Fatalf("tenant b with the same id: %v, %v; want acquired (scopes must not collide)", cb.Outcome, err)
	}
	if cb.Result != nil {
		t.Fatalf("tenant b saw a result %q", cb.Result)
	}
}

func testResultIsCopied(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	buf := []byte("original")
	e.MustComplete(t, c, buf, retention)
	copy(buf, "CHANGED!")
	d := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate)
	if string(d.Result) != "original" {
		t.Fatalf("the store kept the caller's buffer: %q", d.Result)
	}
	copy(d.Result, "CHANGED!")
	if d2 := e.MustClaim(t, "m1", fpA, longLease, dedup.Duplicate); string(d2.Result) != "original" {
		t.Fatalf("the store handed out its own buffer: %q", d2.Result)
	}
}

func testLargeResultAndUnicodeKey(t testing.TB, e *Env) {
	id := "заказ-🧾-" + strings.Repeat("ü", 100)
	big := bytes.Repeat([]byte{0, 1, 2, 0xff, '\n'}, 64<<10/5)
	c := e.MustClaim(t, id, fpA, longLease, dedup.Acquired)
	e.MustComplete(t, c, big, retention)
	if d := e.MustClaim(t, id, fpA, longLease, dedup.Duplicate); !bytes.Equal(d.Result, big) {
		t.Fatalf("a %d-byte binary result came back as %d bytes", len(big), len(d.Result))
	}
}

func testManyKeysParallel(t testing.TB, e *Env) {
	const workers, keys = 8, 100
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			for i := range keys {
				k := e.Key(fmt.Sprintf("w%d-k%d", w, i))
				c, err := e.Store.Claim(ctx, k, fpA, longLease)
				if err != nil || c.Outcome != dedup.Acquired {
					t.Errorf("Claim(%v) = %v, %v", k, c.Outcome, err)
					return
				}
				if err := e.Store.Complete(ctx, c, []byte(k.ID), retention); err != nil {
					t.Errorf("Complete(%v): %v", k, err)
					return
				}
				d, err := e.Store.Claim(ctx, k, fpA, longLease)
				if err != nil || d.Outcome != dedup.Duplicate || string(d.Result) != k.ID {
					t.Errorf("second Claim(%v) = %v %q, %v", k, d.Outcome, d.Result, err)
					return
				}
			}
		}()
	}
	wg.Wait()
}

func testUseAfterClose(t testing.TB, e *Env) {
	c := e.MustClaim(t, "m1", fpA, longLease, dedup.Acquired)
	if err := e.Store.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	ctx := context.Background()
	_, err := e.Store.Claim(ctx, e.Key("m2"), fpA, longLease)
	wantErr(t, "Claim after Close", err, dedup.ErrClosed)
	wantErr(t, "Complete after Close", e.Store.Complete(ctx, c, nil, retention), dedup.ErrClosed)
	wantErr(t, "Release after Close", e.Store.Release(ctx, c), dedup.ErrClosed)
}

func testExtend(t testing.TB, e *Env) {
	x := e.Store.(dedup.Extender)
	ctx := context.Background()
	c := e.MustClaim(t, "m1", fpA, shortLease, dedup.Acquired)
	c2, err := x.Extend(ctx, c, longLease)
	if err != nil || !c2.LeaseUntil.After(c.LeaseUntil) {
		t.Fatalf("Extend = %v, %v; want a later lease end than %v", c2.LeaseUntil, err, c.LeaseUntil)
	}
	e.Advance(pastShort)
	e.MustClaim(t, "m1", fpA, longLease, dedup.InProgress) // the extended lease holds
	forged := c
	forged.Token = dedup.NewToken()
	if _, err := x.Extend(ctx, forged, longLease); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Extend with a foreign token: %v, want ErrLeaseLost", err)
	}
	e.MustComplete(t, c2, nil, retention)
	if _, err := x.Extend(ctx, c2, longLease); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Extend after Complete: %v, want ErrLeaseLost", err)
	}
	if _, err := x.Extend(ctx, c2, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("Extend with a zero lease: %v, want ErrInvalidArgument", err)
	}
}

func testBatchClaim(t testing.TB, e *Env) {
	b := e.Store.(dedup.BatchClaimer)
	done := e.MustClaim(t, "done", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, done, []byte("r"), retention)
	e.MustClaim(t, "busy", fpA, longLease, dedup.Acquired)
	reqs := []dedup.ClaimRequest{
		{Key: e.Key("done"), Fingerprint: fpA},
		{Key: e.Key("busy"), Fingerprint: fpA},
		{Key: e.Key("new"), Fingerprint: fpA},
		{Key: e.Key("twice"), Fingerprint: fpA},
		{Key: e.Key("twice"), Fingerprint: fpA},
		{Key: e.Key("done"), Fingerprint: fpB},
	}
	got, err := b.ClaimBatch(context.Background(), reqs, longLease)
	if err != nil {
		t.Fatalf("ClaimBatch: %v", err)
	}
	want := []dedup.Outcome{dedup.Duplicate, dedup.InProgress, dedup.Acquired, dedup.Acquired, dedup.InProgress, dedup.Mismatch}
	if len(got) != len(want) {
		t.Fatalf("ClaimBatch returned %d claims for %d requests", len(got), len(want))
	}
	for i := range want {
		if got[i].Outcome != want[i] || got[i].Key != reqs[i].Key {
			t.Errorf("batch item %d (%s) = %v for key %v, want %v", i, reqs[i].Key.ID, got[i].Outcome, got[i].Key, want[i])
		}
	}
	if string(got[0].Result) != "r" {
		t.Errorf("batch duplicate result = %q", got[0].Result)
	}
	e.MustComplete(t, got[2], nil, retention)
	e.MustComplete(t, got[3], nil, retention)
	e.MustClaim(t, "new", fpA, longLease, dedup.Duplicate)
	if _, err := b.ClaimBatch(context.Background(), []dedup.ClaimRequest{{Key: dedup.Key{}}}, longLease); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("ClaimBatch with an invalid key: %v", err)
	}
	if got, err := b.ClaimBatch(context.Background(), nil, longLease); err != nil || len(got) != 0 {
		t.Fatalf("empty ClaimBatch = %v, %v", got, err)
	}
}

// testBatchComplete: each item of a batch completion is fenced by its own
// token, as Complete is; one fenced-out item changes nothing and fails
// alone; completing again is a no-op; bad input is refused before any
// item is written.
func testBatchComplete(t testing.TB, e *Env) {
	b := e.Store.(dedup.BatchCompleter)
	ctx := context.Background()
	a := e.MustClaim(t, "a", fpA, longLease, dedup.Acquired)
	stale := e.MustClaim(t, "taken", fpA, shortLease, dedup.Acquired)
	c := e.MustClaim(t, "c", "", longLease, dedup.Acquired)
	e.Advance(pastShort)
	owner := e.MustClaim(t, "taken", fpA, longLease, dedup.Acquired) // a take-over fences out stale
	items := []dedup.Completion{{Claim: a, Result: []byte("ra")}, {Claim: stale, Result: []byte("stale")}, {Claim: c}}
	errs, err := b.CompleteBatch(ctx, items, retention)
	if err != nil || len(errs) != len(items) {
		t.Fatalf("CompleteBatch = %v, %v; want one result per item", errs, err)
	}
	if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], dedup.ErrLeaseLost) {
		t.Fatalf("CompleteBatch item errors %v, want [nil ErrLeaseLost nil]", errs)
	}
	if d := e.MustClaim(t, "a", fpA, longLease, dedup.Duplicate); string(d.Result) != "ra" {
		t.Fatalf("batch-completed result %q, want %q", d.Result, "ra")
	}
	if d := e.MustClaim(t, "c", "", longLease, dedup.Duplicate); len(d.Result) != 0 {
		t.Fatalf("nil result came back as %q", d.Result)
	}
	e.MustClaim(t, "taken", fpA, longLease, dedup.InProgress) // the new owner's record is untouched

	// Again, with other results: the completed items do not change.
	items[0].Result, items[2].Result = []byte("again"), []byte("again")
	errs, err = b.CompleteBatch(ctx, items, retention)
	if err != nil || len(errs) != 3 || errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], dedup.ErrLeaseLost) {
		t.Fatalf("CompleteBatch again = %v, %v; want [nil ErrLeaseLost nil]", errs, err)
	}
	if d := e.MustClaim(t, "a", fpA, longLease, dedup.Duplicate); string(d.Result) != "ra" {
		t.Fatalf("a second batch completion changed the result to %q", d.Result)
	}
	e.MustComplete(t, owner, []byte("owner"), retention)

	// Invalid input: nothing is written, not even the valid items.
	d := e.MustClaim(t, "d", fpA, longLease, dedup.Acquired)
	notOwned := dedup.Claim{Key: e.Key("x"), Outcome: dedup.Duplicate}
	badKey := d
	badKey.Key = dedup.Key{Scope: e.Scope, ID: "bad\x00id"}
	for name, bad := range map[string][]dedup.Completion{
		"a claim that was not acquired": {{Claim: d}, {Claim: notOwned}},
		"an invalid key":                {{Claim: d}, {Claim: badKey}},
	} {
		if _, err := b.CompleteBatch(ctx, bad, retention); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("CompleteBatch with %s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := b.CompleteBatch(ctx, []dedup.Completion{{Claim: d}}, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("CompleteBatch with zero retention: %v, want ErrInvalidArgument", err)
	}
	e.MustClaim(t, "d", fpA, longLease, dedup.InProgress)

	// A cancelled context: a store error, for the call or for every item.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	errs, err = b.CompleteBatch(cctx, []dedup.Completion{{Claim: d}}, retention)
	switch {
	case err != nil && (!dedup.IsStoreError(err) || !errors.Is(err, context.Canceled)):
		t.Fatalf("CompleteBatch with a cancelled context: %v, want a store error wrapping context.Canceled", err)
	case err == nil && (len(errs) != 1 || !dedup.IsStoreError(errs[0])):
		t.Fatalf("CompleteBatch with a cancelled context: items %v, want a store error", errs)
	}
	e.MustClaim(t, "d", fpA, longLease, dedup.InProgress)

	if errs, err := b.CompleteBatch(ctx, nil, retention); err != nil || len(errs) != 0 {
		t.Fatalf("empty CompleteBatch = %v, %v", errs, err)
	}
	e.MustComplete(t, d, nil, retention)
}

func testSweep(t testing.TB, e *Env) {
	sw := e.Store.(dedup.Sweeper)
	ctx := context.Background()
	for i := range 10 {
		c := e.MustClaim(t, fmt.Sprintf("old-%d", i), fpA, longLease, dedup.Acquired)
		e.MustComplete(t, c, nil, shortLease)
	}
	keep := e.MustClaim(t, "live", fpA, longLease, dedup.Acquired)
	e.MustComplete(t, keep, []byte("keep"), retention)
	busy := e.MustClaim(t, "busy", fpA, longLease, dedup.Acquired)
	e.Advance(pastShort)
	n, err := sw.Sweep(ctx, 4)
	if err != nil || n != 4 {
		t.Fatalf("Sweep(4) = %d, %v; want 4 of the 10 expired records", n, err)
	}
	n, err = sw.Sweep(ctx, 1000)
	if err != nil || n < 6 || (e.Features.ManualClock && n != 6) {
		t.Fatalf("Sweep(1000) = %d, %v; want the 6 expired records left", n, err)
	}
	e.MustClaim(t, "live", fpA, longLease, dedup.Duplicate)
	e.MustClaim(t, "busy", fpA, longLease, dedup.InProgress)
	c := e.MustClaim(t, "old-0", fpA, longLease, dedup.Acquired)
	if c.Attempt != 1 {
		t.Fatalf("a swept key claimed again: attempt %d, want 1", c.Attempt)
	}
	e.MustComplete(t, busy, nil, retention)
	if _, err := sw.Sweep(ctx, 0); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("Sweep(0): %v, want ErrInvalidArgument", err)
	}
}
