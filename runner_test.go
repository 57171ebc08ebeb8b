package dedup_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

func newMem(t *testing.T) (*memstore.Store, *storetest.Clock) {
	t.Helper()
	clock := storetest.NewClock()
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s, clock
}

func newRunner(t *testing.T, s dedup.Store, opts ...dedup.RunnerOption) *dedup.Runner {
	t.Helper()
	r, err := dedup.NewRunner(s, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

var key = dedup.Key{Scope: "test", ID: "m1"}

type rejected struct{ reason string }

func (e rejected) Error() string  { return "rejected: " + e.reason }
func (e rejected) Result() []byte { return []byte(`{"status":"rejected","reason":"` + e.reason + `"}`) }

var errUnknown = errors.New("provider timed out: outcome unknown")

func classify(err error) dedup.Disposition {
	var r rejected
	switch {
	case errors.As(err, &r):
		return dedup.Record
	case errors.Is(err, errUnknown):
		return dedup.Keep
	}
	return dedup.Release
}

func TestRunnerDispositions(t *testing.T) {
	ctx := context.Background()
	t.Run("release: the redelivery runs again", func(t *testing.T) {
		s, _ := newMem(t)
		r := newRunner(t, s, dedup.WithClassifier(classify))
		runs := 0
		h := func(context.Context) ([]byte, error) {
			if runs++; runs == 1 {
				return nil, errors.New("transient")
			}
			return []byte("ok"), nil
		}
		if _, err := r.Do(ctx, key, "", h); err == nil {
			t.Fatal("first run: want the handler's error")
		}
		if res, err := r.Do(ctx, key, "", h); err != nil || res.Duplicate || string(res.Result) != "ok" || runs != 2 {
			t.Fatalf("redelivery: %+v %v, runs %d", res, err, runs)
		}
	})
	t.Run("keep: held for one lease, then taken over", func(t *testing.T) {
		s, clock := newMem(t)
		r := newRunner(t, s, dedup.WithClassifier(classify), dedup.WithLease(time.Minute))
		runs := 0
		h := func(context.Context) ([]byte, error) {
			if runs++; runs == 1 {
				return nil, errUnknown
			}
			return []byte("reconciled"), nil
		}
		if _, err := r.Do(ctx, key, "", h); !errors.Is(err, errUnknown) {
			t.Fatalf("first run: %v", err)
		}
		_, err := r.Do(ctx, key, "", h)
		var ip *dedup.InProgressError
		if !errors.As(err, &ip) || ip.RetryAfter(clock.Now()) != time.Minute {
			t.Fatalf("retry inside the lease: %v, want in progress for one minute", err)
		}
		clock.Advance(time.Minute + time.Second)
		res, err := r.Do(ctx, key, "", h)
		if err != nil || !res.TakenOver || res.Attempt != 2 || runs != 2 {
			t.Fatalf("retry after the lease: %+v %v runs %d; want a take-over at attempt 2", res, err, runs)
		}
	})
	t.Run("record: a business rejection is final", func(t *testing.T) {
		s, _ := newMem(t)
		r := newRunner(t, s, dedup.WithClassifier(classify))
		runs := 0
		h := func(context.Context) ([]byte, error) { runs++; return nil, rejected{"card declined"} }
		res, err := r.Do(ctx, key, "", h)
		if !errors.As(err, new(rejected)) || !res.Recorded {
			t.Fatalf("first run: %+v %v", res, err)
		}
		res, err = r.Do(ctx, key, "", h)
		if err != nil || !res.Duplicate || string(res.Result) != `{"status":"rejected","reason":"card declined"}` || runs != 1 {
			t.Fatalf("redelivery of a rejection: %+v %v runs %d; want a duplicate with the recorded outcome", res, err, runs)
		}
	})
}

func TestRunnerPanicReleases(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic was swallowed")
			}
		}()
		r.Do(context.Background(), key, "", func(context.Context) ([]byte, error) { panic("bug") })
	}()
	ran := false
	if _, err := r.Do(context.Background(), key, "", func(context.Context) ([]byte, error) { ran = true; return nil, nil }); err != nil || !ran {
		t.Fatalf("after a panic the key must be claimable at once: %v ran=%v", err, ran)
	}
}

// TestRunnerCancelAfterSuccessStillCompletes: a cancel that arrives after
// the effect must not leave the success unrecorded.
func TestRunnerCancelAfterSuccessStillCompletes(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	res, err := r.Do(ctx, key, "", func(context.Context) ([]byte, error) {
		cancel() // e.g. shutdown began while the charge went through
		return []byte("charged"), nil
	})
	if err != nil || string(res.Result) != "charged" {
		t.Fatalf("Do = %+v, %v", res, err)
	}
	c, err := s.Claim(context.Background(), key, "", time.Minute)
	if err != nil || c.Outcome != dedup.Duplicate {
		t.Fatalf("after a cancel the success was not recorded: %v %v", c.Outcome, err)
	}
}

// TestRunnerCancelMidHandlerReleases: a handler that gives up on cancel
// leaves the key claimable, not stuck for a lease.
func TestRunnerCancelMidHandlerReleases(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	_, err := r.Do(ctx, key, "", func(ctx context.Context) ([]byte, error) {
		cancel()
		<-ctx.Done()
		return nil, ctx.Err()
	})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Do = %v, want context.Canceled", err)
	}
	if c, _ := s.Claim(context.Background(), key, "", time.Minute); c.Outcome != dedup.Acquired {
		t.Fatalf("after a cancelled handler the key is %v, want claimable", c.Outcome)
	}
}

// failing wraps a store and fails chosen calls, as a store that goes away
// mid-call does.
type failing struct {
	dedup.Store
	claim, complete bool
}

var errDown = &dedup.StoreError{Store: "test", Op: "x", Err: errors.New("connection refused")}

func (f *failing) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, l time.Duration) (dedup.Claim, error) {
	if f.claim {
		return dedup.Claim{}, errDown
	}
	return f.Store.Claim(ctx, k, fp, l)
}

func (f *failing) Complete(ctx context.Context, c dedup.Claim, res []byte, ret time.Duration) error {
	if f.complete {
		return errDown
	}
	return f.Store.Complete(ctx, c, res, ret)
}

func TestRunnerFailsClosed(t *testing.T) {
	s, _ := newMem(t)
	ran := 0
	h := func(context.Context) ([]byte, error) { ran++; return nil, nil }
	res, err := newRunner(t, &failing{Store: s, claim: true}).Do(context.Background(), key, "", h)
	if !dedup.IsStoreError(err) || res.Duplicate || ran != 0 {
		t.Fatalf("claim on a dead store: %+v %v ran %d; want a store error, no run, not a duplicate", res, err, ran)
	}
	res, err = newRunner(t, &failing{Store: s, complete: true}).Do(context.Background(), key, "", h)
	if !dedup.IsStoreError(err) || res.Duplicate || ran != 1 {
		t.Fatalf("complete on a dead store: %+v %v; want a store error so the caller does not ack", res, err)
	}
}

type counter struct {
	claims, dups, takeovers, finishes, storeErrs atomic.Int32
}

func (c *counter) OnClaim(context.Context, dedup.ClaimEvent)           { c.claims.Add(1) }
func (c *counter) OnDuplicate(context.Context, dedup.DuplicateEvent)   { c.dups.Add(1) }
func (c *counter) OnTakeover(context.Context, dedup.TakeoverEvent)     { c.takeovers.Add(1) }
func (c *counter) OnFinish(context.Context, dedup.FinishEvent)         { c.finishes.Add(1) }
func (c *counter) OnStoreError(context.Context, dedup.StoreErrorEvent) { c.storeErrs.Add(1) }

func TestRunnerHooks(t *testing.T) {
	s, clock := newMem(t)
	var n counter
	var names []string
	logHook := dedup.HookFunc(func(_ context.Context, e any) {
		if d, ok := e.(dedup.DuplicateEvent); ok {
			names = append(names, d.Store)
		}
	})
	r := newRunner(t, s, dedup.WithName("memory"), dedup.WithHooks(&n, logHook), dedup.WithLease(time.Second),
		dedup.WithClassifier(func(error) dedup.Disposition { return dedup.Keep }))
	ctx := context.Background()
	ok := func(context.Context) ([]byte, error) { return nil, nil }
	r.Do(ctx, key, "", func(context.Context) ([]byte, error) { return nil, errors.New("x") }) // claim, keep
	clock.Advance(2 * time.Second)
	r.Do(ctx, key, "", ok) // claim (take-over), complete
	r.Do(ctx, key, "", ok) // claim (duplicate)
	newRunner(t, &failing{Store: s, claim: true}, dedup.WithHooks(&n)).Do(ctx, key, "", ok)
	got := [5]int32{n.claims.Load(), n.dups.Load(), n.takeovers.Load(), n.finishes.Load(), n.storeErrs.Load()}
	if want := [5]int32{4, 1, 1, 2, 1}; got != want {
		t.Fatalf("hook counts (claims, duplicates, take-overs, finishes, store errors) = %v, want %v", got, want)
	}
	if len(names) != 1 || names[0] != "memory" {
		t.Fatalf("duplicate events named %v, want the runner's store name", names)
	}
}

// TestRunnerHeartbeat: a handler that outlives its lease keeps it while
// the heartbeat runs, and learns through its context when it is lost.
func TestRunnerHeartbeat(t *testing.T) {
	s, clock := newMem(t)
	r := newRunner(t, s, dedup.WithLease(time.Minute), dedup.WithHeartbeat(5*time.Millisecond))
	_, err := r.Do(context.Background(), key, "", func(ctx context.Context) ([]byte, error) {
		// Let a beat extend the lease: then 50s later the key is still held.
		c0, _ := s.Claim(context.Background(), key, "", time.Minute)
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
			clock.Advance(time.Second)
			c, _ := s.Claim(context.Background(), key, "", time.Minute)
			if c.Outcome != dedup.InProgress {
				t.Fatalf("while the heartbeat runs the key is %v", c.Outcome)
			}
			if c.LeaseUntil.After(c0.LeaseUntil) {
				break
			}
		}
		// Now let the lease lapse and someone take over.
		clock.Advance(2 * time.Minute)
		if c, _ := s.Claim(context.Background(), key, "", time.Minute); c.Outcome != dedup.Acquired || !c.TakenOver {
			t.Fatalf("take-over after the lapse: %v", c.Outcome)
		}
		select {
		case <-ctx.Done():
			return nil, context.Cause(ctx)
		case <-time.After(10 * time.Second):
			return nil, errors.New("the handler was not told that its lease was lost")
		}
	})
	if !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Do = %v, want the handler to stop with ErrLeaseLost", err)
	}
}

func TestNewRunnerRejectsBadOptions(t *testing.T) {
	s, _ := newMem(t)
	for name, opt := range map[string]dedup.RunnerOption{
		"zero lease":          dedup.WithLease(0),
		"negative retention":  dedup.WithRetention(-1),
		"heartbeat >= lease":  dedup.WithHeartbeat(time.Hour),
		"nil classifier":      dedup.WithClassifier(nil),
		"zero finalize bound": dedup.WithFinalizeTimeout(0),
	} {
		if _, err := dedup.NewRunner(s, opt); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := dedup.NewRunner(nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("nil store: %v", err)
	}
}
