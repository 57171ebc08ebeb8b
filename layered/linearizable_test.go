package layered_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/layered"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// gated is a fast store whose Release and Complete stop, once armed,
// until the test lets them go, so the test can look at the layered store
// between its two steps.
type gated struct {
	*memstore.Store
	mu      sync.Mutex
	armed   bool
	entered chan struct{}
	proceed chan struct{}
}

func (g *gated) wait() {
	g.mu.Lock()
	armed := g.armed
	g.armed = false
	g.mu.Unlock()
	if armed {
		close(g.entered)
		<-g.proceed
	}
}

func (g *gated) arm() {
	g.mu.Lock()
	g.armed, g.entered, g.proceed = true, make(chan struct{}), make(chan struct{})
	g.mu.Unlock()
}

func (g *gated) Release(ctx context.Context, c dedup.Claim) error {
	g.wait()
	return g.Store.Release(ctx, c)
}

func (g *gated) Complete(ctx context.Context, c dedup.Claim, res []byte, ret time.Duration) error {
	g.wait()
	return g.Store.Complete(ctx, c, res, ret)
}

// TestBetweenStepsIsConsistent is issue 12's reproduction C: while a
// Release or Complete is between its durable and its fast step, the old
// owner's fenced call and a new Claim must agree. If the old token is
// already dead (Extend says lease lost), a new Claim must not answer "in
// progress" with the dead owner's lease.
func TestBetweenStepsIsConsistent(t *testing.T) {
	for _, op := range []string{"release", "complete"} {
		t.Run(op, func(t *testing.T) {
			clock := storetest.NewClock()
			fast := &gated{Store: mem(t, clock)}
			s := newLayered(t, layered.WithFast(fast, "fast"), layered.WithDurable(mem(t, clock), "durable"), layered.WithClock(clock))
			ctx := context.Background()
			k := dedup.Key{Scope: "lin", ID: op}
			c, err := s.Claim(ctx, k, "", 10*time.Minute)
			if err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("Claim = %v, %v", c.Outcome, err)
			}
			fast.arm()
			done := make(chan error, 1)
			go func() {
				if op == "release" {
					done <- s.Release(ctx, c)
				} else {
					done <- s.Complete(ctx, c, []byte("r"), time.Hour)
				}
			}()
			select {
			case <-fast.entered:
			case err := <-done:
				t.Fatalf("%s returned (%v) without reaching the fast store", op, err)
			}
			_, extErr := s.Extend(ctx, c, 10*time.Minute)
			nc, err := s.Claim(ctx, k, "", 10*time.Minute)
			if err != nil {
				t.Fatal(err)
			}
			if errors.Is(extErr, dedup.ErrLeaseLost) && nc.Outcome == dedup.InProgress {
				t.Fatalf("between the steps of %s the old token is dead (Extend: %v) but a new Claim answers in progress until %v",
					op, extErr, nc.LeaseUntil)
			}
			close(fast.proceed)
			if err := <-done; err != nil {
				t.Fatalf("%s: %v", op, err)
			}
			if nc.Outcome == dedup.Acquired {
				if err := s.Release(ctx, nc); err != nil {
					t.Fatal(err)
				}
			}
			after, err := s.Claim(ctx, k, "", 10*time.Minute)
			want := map[string]dedup.Outcome{"release": dedup.Acquired, "complete": dedup.Duplicate}[op]
			if err != nil || after.Outcome != want {
				t.Fatalf("after %s: Claim = %v, %v; want %v", op, after.Outcome, err, want)
			}
		})
	}
}

// cancelling is a durable store whose Claim sees the caller's context end
// (it cancels it, as a caller's deadline would at that instant) and then
// fails closed with a store error, as every store does on a done context.
type cancelling struct {
	dedup.Store
	cancel context.CancelFunc
}

func (c cancelling) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	c.cancel()
	return c.Store.Claim(ctx, k, fp, lease)
}

// TestCancelBetweenStepsLeavesNoOrphan is issue 12's reproduction B:
// when the caller's context ends after the fast store acquired and before
// the durable claim, the durable claim fails closed and the fast claim is
// released anyway (on a detached context): nothing is left that answers
// "in progress" for a whole lease. The same for RunInbox's durable step.
func TestCancelBetweenStepsLeavesNoOrphan(t *testing.T) {
	clock := storetest.NewClock()
	fast := mem(t, clock)
	ctx, cancel := context.WithCancel(context.Background())
	s := newLayered(t, layered.WithFast(fast, "fast"),
		layered.WithDurable(cancelling{Store: mem(t, clock), cancel: cancel}, "durable"), layered.WithClock(clock))
	k := dedup.Key{Scope: "orphan", ID: "claim"}
	if _, err := s.Claim(ctx, k, "", 10*time.Minute); !dedup.IsStoreError(err) {
		t.Fatalf("Claim on a context that ended mid-call: %v, want a store error", err)
	}
	if c, err := fast.Claim(context.Background(), k, "", time.Minute); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("the fast store still holds the key: %v, %v (an orphaned claim)", c.Outcome, err)
	}

	ctx2, cancel2 := context.WithCancel(context.Background())
	k2 := dedup.Key{Scope: "orphan", ID: "inbox"}
	_, err := s.RunInbox(ctx2, k2, "", time.Hour, func(ctx context.Context) (dedup.Claim, error) {
		cancel2()
		return dedup.Claim{}, &dedup.StoreError{Store: "sql", Op: "inbox", Err: ctx.Err(), NotApplied: true}
	})
	if !dedup.IsStoreError(err) {
		t.Fatalf("RunInbox: %v, want the durable step's store error", err)
	}
	if c, err := fast.Claim(context.Background(), k2, "", time.Minute); err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("RunInbox left the fast claim behind: %v, %v", c.Outcome, err)
	}
}

// TestStaleFastLeaseIsOverruled: a fast claim orphaned by a crash (no
// owner will ever finish it) does not hold the key: Claim asks the durable
// store, which acquires, and counts the overruled answer.
func TestStaleFastLeaseIsOverruled(t *testing.T) {
	clock := storetest.NewClock()
	fast := mem(t, clock)
	s := newLayered(t, layered.WithFast(fast, "fast"), layered.WithDurable(mem(t, clock), "durable"), layered.WithClock(clock))
	k := dedup.Key{Scope: "stale", ID: "1"}
	if c, err := fast.Claim(context.Background(), k, "", time.Hour); err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	c, err := s.Claim(context.Background(), k, "", time.Minute)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("Claim behind an orphaned fast lease = %v, %v; want acquired from the durable store", c.Outcome, err)
	}
	if got := s.Stats().FastUnsure; got != 1 {
		t.Fatalf("FastUnsure = %d, want 1", got)
	}
	if err := s.Complete(context.Background(), c, []byte("x"), time.Hour); err != nil {
		t.Fatal(err)
	}
	if again, _ := s.Claim(context.Background(), k, "", time.Minute); again.Outcome != dedup.Duplicate {
		t.Fatalf("after completion: %v, want duplicate", again.Outcome)
	}
}

// slowUnchecked is a durable store whose Claim without a fingerprint
// waits until the test lets it go (a slow round trip).
type slowUnchecked struct {
	*memstore.Store
	entered, proceed chan struct{}
}

func (s *slowUnchecked) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if fp == "" {
		close(s.entered)
		<-s.proceed
	}
	return s.Store.Claim(ctx, k, fp, lease)
}

// TestUncheckedClaimNeverWidensFastCopy (found by review): a claim
// without a fingerprint must not leave a fast-store copy that matches
// every payload when the durable record has a fingerprint, or a later
// request with another payload is answered "duplicate" with someone
// else's result instead of "mismatch". Two ways there: a concurrent
// delivery completed first (the unchecked one's durable answer is a
// duplicate), and a take-over of a record whose fast copy was lost (the
// durable store keeps the record's fingerprint).
func TestUncheckedClaimNeverWidensFastCopy(t *testing.T) {
	const fpB, fpH = dedup.Fingerprint("sha256:bbbb"), dedup.Fingerprint("sha256:hhhh")
	ctx := context.Background()
	t.Run("concurrent", func(t *testing.T) {
		clock := storetest.NewClock()
		durable := &slowUnchecked{Store: mem(t, clock), entered: make(chan struct{}), proceed: make(chan struct{})}
		s := newLayered(t, layered.WithFast(mem(t, clock), "fast"), layered.WithDurable(durable, "durable"), layered.WithClock(clock))
		k := dedup.Key{Scope: "fp", ID: "concurrent"}
		first := make(chan dedup.Claim, 1)
		go func() {
			c, err := s.Claim(ctx, k, "", time.Minute)
			if err != nil {
				t.Error(err)
			}
			first <- c
		}()
		<-durable.entered
		c, err := s.Claim(ctx, k, fpB, time.Minute)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Fatalf("claim with B: %v, %v", c.Outcome, err)
		}
		if err := s.Complete(ctx, c, []byte("result-of-B"), time.Hour); err != nil {
			t.Fatal(err)
		}
		close(durable.proceed)
		if d := <-first; d.Outcome != dedup.Duplicate {
			t.Fatalf("the unchecked delivery: %v, want duplicate", d.Outcome)
		}
		if l, err := s.Claim(ctx, k, fpH, time.Minute); err != nil || l.Outcome != dedup.Mismatch {
			t.Fatalf("another payload after the backfill: %v %q %v; the durable store says mismatch", l.Outcome, l.Result, err)
		}
	})
	t.Run("takeover", func(t *testing.T) {
		clock := storetest.NewClock()
		fast, durable := mem(t, clock), mem(t, clock)
		s := newLayered(t, layered.WithFast(fast, "fast"), layered.WithDurable(durable, "durable"), layered.WithClock(clock))
		k := dedup.Key{Scope: "fp", ID: "takeover"}
		// An owner with payload B dies; its durable record outlives the
		// fast store's copy (Redis lost it, or its TTL ran out first).
		if c, err := durable.Claim(ctx, k, fpB, time.Second); err != nil || c.Outcome != dedup.Acquired {
			t.Fatal(c.Outcome, err)
		}
		clock.Advance(2 * time.Second)
		c, err := s.Claim(ctx, k, "", time.Minute)
		if err != nil || c.Outcome != dedup.Acquired || !c.TakenOver {
			t.Fatalf("unchecked take-over: %v (taken over %v), %v", c.Outcome, c.TakenOver, err)
		}
		if err := s.Complete(ctx, c, []byte("result-of-B"), time.Hour); err != nil {
			t.Fatal(err)
		}
		if l, err := s.Claim(ctx, k, fpH, time.Minute); err != nil || l.Outcome != dedup.Mismatch {
			t.Fatalf("another payload after the take-over: %v %q %v; the durable record keeps B", l.Outcome, l.Result, err)
		}
		if l, err := s.Claim(ctx, k, fpB, time.Minute); err != nil || l.Outcome != dedup.Duplicate {
			t.Fatalf("the same payload: %v %v, want duplicate", l.Outcome, err)
		}
	})
}
