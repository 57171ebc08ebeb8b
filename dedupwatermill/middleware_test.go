package dedupwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// A handler that fails on the first delivery runs again on the
// redelivery and its effect happens once; Watermill's Deduplicator drops
// that redelivery as a duplicate and the effect never happens.
func TestHandlerFailsFirstDelivery(t *testing.T) {
	for _, e := range engines {
		t.Run(e.name, func(t *testing.T) {
			store := e.open(t)()
			mw := newMiddleware(t, store)
			effects, calls := runFailingFirst(t, mw.Middleware)
			if effects != 1 || calls != 2 {
				t.Fatalf("effects %d calls %d, want 1 and 2", effects, calls)
			}
			waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
			if s := mw.Stats(); s.Released != 1 || s.Acquired != 2 {
				t.Fatalf("stats %+v: want 1 release, 2 acquisitions", s)
			}
		})
	}
	t.Run("watermill-deduplicator", func(t *testing.T) {
		d := &middleware.Deduplicator{KeyFactory: func(m *message.Message) (string, error) { return m.UUID, nil }}
		effects, calls := runFailingFirst(t, d.Middleware)
		if effects != 0 || calls != 1 {
			t.Fatalf("the peer's deduplicator: effects %d calls %d; the measured loss (0 and 1) changed", effects, calls)
		}
	})
}

// runFailingFirst sends one message through a router with mw; the handler
// fails its first call. It returns the handler's successful effects and
// calls once the message is acked (or, for a middleware that drops the
// redelivery, once the redelivery was acked without a call).
func runFailingFirst(t *testing.T, mw message.HandlerMiddleware) (effects, calls int64) {
	ps := newPubSub(t)
	r := newRouter(t)
	var c, ok atomic.Int64
	acks := make(chan struct{}, 8)
	r.AddNoPublisherHandler("h", "in", ps, func(m *message.Message) error {
		if c.Add(1) == 1 {
			return errors.New("database briefly unavailable")
		}
		ok.Add(1)
		return nil
	})
	r.AddMiddleware(func(h message.HandlerFunc) message.HandlerFunc {
		return func(m *message.Message) ([]*message.Message, error) {
			out, err := h(m)
			if err == nil {
				acks <- struct{}{}
			}
			return out, err
		}
	}, mw)
	startRouter(t, r)
	if err := ps.Publish("in", message.NewMessage("m-1", []byte(`{"id":1}`))); err != nil {
		t.Fatal(err)
	}
	select {
	case <-acks:
	case <-time.After(20 * time.Second):
		t.Fatal("the message was never acked")
	}
	return ok.Load(), c.Load()
}

// The router's publish of the handler's produced messages fails: the
// message is nacked after the handler's effect ran, so the claim is kept
// (never released: the effect happened), the redelivery waits for the
// lease, takes the key over and runs the handler again (it sees TakenOver
// and can reconcile), and the outputs are published once, when the
// publish works. A later duplicate re-emits nothing.
func TestProducedPublishFails(t *testing.T) {
	t.Run("memstore", func(t *testing.T) {
		clock := storetest.NewClock()
		store, err := memstore.New(memstore.WithClock(clock))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
		producedPublishFails(t, store, time.Minute, func() { clock.Advance(time.Minute + time.Second) })
	})
	for _, e := range engines[1:] {
		t.Run(e.name, func(t *testing.T) {
			// The server's clock ends the lease: a short one.
			producedPublishFails(t, e.open(t)(), time.Second, nil)
		})
	}
}

// producedPublishFails runs the test on store; expire ends the lease on a
// manual clock, or is nil when the server's clock ends it.
func producedPublishFails(t *testing.T, store dedup.Store, lease time.Duration, expire func()) {
	mw := newMiddleware(t, store, dedupwatermill.WithLease(lease))
	ps := newPubSub(t)
	out := collect(t, ps, "out")
	pub := &flakyPublisher{Publisher: ps}
	pub.fails.Store(1)
	r := newRouter(t)
	var runs, takeovers atomic.Int64
	r.AddHandler("h", "in", ps, "out", pub, func(m *message.Message) ([]*message.Message, error) {
		runs.Add(1)
		if c, ok := dedupwatermill.ClaimFrom(m.Context()); ok && c.TakenOver {
			takeovers.Add(1)
		}
		return message.Messages{message.NewMessage("out-of-"+m.UUID, m.Payload)}, nil
	})
	r.AddMiddleware(mw.Middleware)
	startRouter(t, r)
	if err := ps.Publish("in", message.NewMessage("m-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the nack after the failed publish", func() bool { return mw.Stats().Kept == 1 })
	waitFor(t, "a redelivery refused while the lease lives", func() bool { return mw.Stats().InProgress >= 1 })
	if expire != nil { // a manual clock: the lease cannot have ended yet
		if n := runs.Load(); n != 1 {
			t.Fatalf("the handler ran %d times before the lease ended, want 1", n)
		}
		expire()
	}
	waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
	waitFor(t, "the output", func() bool { return out.n.Load() == 1 })
	if runs.Load() != 2 || takeovers.Load() != 1 {
		t.Fatalf("runs %d takeovers %d, want 2 and 1", runs.Load(), takeovers.Load())
	}
	// A duplicate: no run, no output.
	if err := ps.Publish("in", message.NewMessage("m-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the duplicate", func() bool { return mw.Stats().Duplicates == 1 })
	if runs.Load() != 2 || out.count("out-of-m-1") != 1 || pub.calls.Load() != 2 {
		t.Fatalf("after the duplicate: runs %d outputs %d publishes %d, want 2, 1, 2", runs.Load(), out.count("out-of-m-1"), pub.calls.Load())
	}
}

// 32 deliveries of one message at once (32 subscriptions of one topic,
// which gochannel fans out) run the handler once; the others are refused
// while it runs and acked as duplicates after it completed.
func TestConcurrentDeliveries(t *testing.T) {
	const n = 32
	for _, e := range engines {
		t.Run(e.name, func(t *testing.T) {
			store := e.open(t)()
			mw := newMiddleware(t, store)
			ps := newPubSub(t)
			r := newRouter(t)
			var runs atomic.Int64
			for i := range n {
				r.AddNoPublisherHandler("h"+strconv.Itoa(i), "in", ps, func(m *message.Message) error {
					runs.Add(1)
					// Hold the claim until every other delivery was refused.
					for mw.Stats().InProgress < n-1 {
						time.Sleep(time.Millisecond)
					}
					return nil
				})
			}
			r.AddMiddleware(mw.Middleware)
			startRouter(t, r)
			if err := ps.Publish("in", message.NewMessage("m-1", []byte("p"))); err != nil {
				t.Fatal(err)
			}
			waitFor(t, "31 duplicates", func() bool { return mw.Stats().Duplicates == n-1 })
			if got := runs.Load(); got != 1 {
				t.Fatalf("the handler ran %d times, want 1", got)
			}
			if s := mw.Stats(); s.Acquired != 1 || s.Completed != 1 {
				t.Fatalf("stats %+v", s)
			}
		})
	}
}

// A duplicate that arrives after the router and the middleware were
// restarted on a new handle of a durable store is acked without a run.
func TestDuplicateAcrossRestart(t *testing.T) {
	for _, e := range engines[1:] {
		t.Run(e.name, func(t *testing.T) {
			open := e.open(t)
			var runs atomic.Int64
			for round := range 2 {
				mw, err := dedupwatermill.New(open(), "orders")
				if err != nil {
					t.Fatal(err)
				}
				ps := newPubSub(t)
				r := newRouter(t)
				r.AddNoPublisherHandler("h", "in", ps, func(*message.Message) error { runs.Add(1); return nil })
				r.AddMiddleware(mw.Middleware)
				stop := startRouter(t, r)
				if err := ps.Publish("in", message.NewMessage("m-1", []byte("p"))); err != nil {
					t.Fatal(err)
				}
				if round == 0 {
					waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
				} else {
					waitFor(t, "the duplicate", func() bool { return mw.Stats().Duplicates == 1 })
				}
				stop()
				mw.Close()
			}
			if runs.Load() != 1 {
				t.Fatalf("runs %d, want 1", runs.Load())
			}
		})
	}
}

// The documented order: PoisonQueueWithFilter(ShouldPoison) outermost,
// then Retry, then the dedup middleware next to the handler.
func TestRetryAndPoisonQueue(t *testing.T) {
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	mw := newMiddleware(t, store)
	ps := newPubSub(t)
	poisoned := collect(t, ps, "poison")
	poison, err := middleware.PoisonQueueWithFilter(ps, "poison", dedupwatermill.ShouldPoison)
	if err != nil {
		t.Fatal(err)
	}
	retry := middleware.Retry{MaxRetries: 3, InitialInterval: time.Millisecond, MaxInterval: 5 * time.Millisecond, Multiplier: 2}
	r := newRouter(t)
	var mu sync.Mutex
	calls := map[string]int{}
	effects := map[string]int{}
	r.AddNoPublisherHandler("h", "in", ps, func(m *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		calls[m.UUID]++
		switch {
		case m.UUID == "flaky" && calls[m.UUID] <= 2:
			return errors.New("transient")
		case m.UUID == "poison":
			return consumer.Permanent(errors.New("cannot parse"))
		}
		effects[m.UUID]++
		return nil
	})
	r.AddMiddleware(poison, retry.Middleware, mw.Middleware)
	startRouter(t, r)

	// A key held by another consumer: Retry backs off on ErrInProgress,
	// the poison queue lets it through to a nack, and it runs once the
	// other owner gives the key up.
	held, err := store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: "held"}, "", time.Hour)
	if err != nil || held.Outcome != dedup.Acquired {
		t.Fatal(held, err)
	}
	for _, id := range []string{"flaky", "poison", "held"} {
		if err := ps.Publish("in", message.NewMessage(id, []byte(id))); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "the poisoned message", func() bool { return poisoned.n.Load() == 1 })
	waitFor(t, "retries of the held key", func() bool { return mw.Stats().InProgress >= 8 })
	if err := store.Release(context.Background(), held); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "completions", func() bool { return mw.Stats().Completed == 2 })
	mu.Lock()
	defer mu.Unlock()
	if effects["flaky"] != 1 || calls["flaky"] != 3 || effects["held"] != 1 || calls["held"] != 1 || calls["poison"] != 4 {
		t.Fatalf("calls %v effects %v", calls, effects)
	}
	if poisoned.count("poison") != 1 || poisoned.count("held") != 0 {
		t.Fatalf("poisoned %v", poisoned.seen)
	}
	// The poisoned key was released: a replay from the poison queue runs.
	c, err := store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: "poison"}, dedup.FingerprintOf([]byte("poison")), time.Second)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("the poisoned key is not free for a replay: %v %v", c.Outcome, err)
	}
}

// failingStore fails every Claim with a store error while down is set.
type failingStore struct {
	dedup.Store
	down atomic.Bool
}

func (f *failingStore) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if f.down.Load() {
		return dedup.Claim{}, &dedup.StoreError{Op: "claim", Err: errors.New("connection refused")}
	}
	return f.Store.Claim(ctx, k, fp, lease)
}

// With the store down the middleware fails closed: no run, an error the
// router nacks on; once the store is back the message runs once.
func TestStoreDownFailsClosed(t *testing.T) {
	ms, _ := memstore.New()
	store := &failingStore{Store: ms}
	store.down.Store(true)
	mw := newMiddleware(t, store)
	var runs atomic.Int64
	h := mw.Middleware(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })
	msg := message.NewMessage("m-1", []byte("p"))
	if _, err := h(msg); !dedup.IsStoreError(err) || dedupwatermill.ShouldPoison(err) {
		t.Fatalf("err %v: want a store error kept out of the poison queue", err)
	}
	if runs.Load() != 0 || mw.Stats().StoreErrors != 1 {
		t.Fatalf("runs %d stats %+v", runs.Load(), mw.Stats())
	}
	store.down.Store(false)
	for range 2 {
		m := msg.Copy()
		if _, err := h(m); err != nil {
			t.Fatal(err)
		}
		m.Ack()
		waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
	}
	if runs.Load() != 1 || mw.Stats().Duplicates != 1 {
		t.Fatalf("runs %d stats %+v", runs.Load(), mw.Stats())
	}
}

// The same UUID with another payload is a conflict, never a duplicate;
// a business key in metadata dedups two UUIDs carrying one intent; a
// message without the metadata field is refused before any store call.
func TestKeysAndFingerprints(t *testing.T) {
	store, _ := memstore.New()
	mw := newMiddleware(t, store)
	var runs atomic.Int64
	run := func(h message.HandlerFunc, m *message.Message) error {
		_, err := h(m)
		if err == nil {
			m.Ack()
		}
		return err
	}
	h := mw.Middleware(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })
	if err := run(h, message.NewMessage("m-1", []byte("a"))); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
	if err := run(h, message.NewMessage("m-1", []byte("b"))); !errors.Is(err, dedup.ErrFingerprintMismatch) || !dedupwatermill.ShouldPoison(err) {
		t.Fatalf("reused key: %v", err)
	}

	biz := newMiddleware(t, store, dedupwatermill.WithMetadataKey("payment_id"), dedupwatermill.WithoutFingerprint())
	hb := biz.Middleware(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })
	for i := range 2 {
		m := message.NewMessage(fmt.Sprint("uuid-", i), []byte(fmt.Sprint(`{"attempt":`, i, `}`)))
		m.Metadata.Set("payment_id", "pay-7")
		if err := run(hb, m); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "completion", func() bool { return biz.Stats().Completed == 1 })
	}
	if err := run(hb, message.NewMessage("uuid-x", nil)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("missing metadata: %v", err)
	}
	if runs.Load() != 2 || biz.Stats().Duplicates != 1 || biz.Stats().Acquired != 1 {
		t.Fatalf("runs %d stats %+v", runs.Load(), biz.Stats())
	}
}

// A business rejection is recorded (acked, completed with its result); an
// unknown outcome (a timeout) keeps the claim; a panic keeps it too.
func TestClassifiedFailures(t *testing.T) {
	clock := storetest.NewClock()
	store, _ := memstore.New(memstore.WithClock(clock))
	mw := newMiddleware(t, store, dedupwatermill.WithLease(time.Minute))
	h := mw.Middleware(func(m *message.Message) ([]*message.Message, error) {
		switch m.UUID {
		case "reject":
			return nil, consumer.Reject(errors.New("insufficient funds"), []byte("rejected"))
		case "timeout":
			return nil, fmt.Errorf("charge: %w", context.DeadlineExceeded)
		}
		panic("boom")
	})
	m := message.NewMessage("reject", nil)
	if out, err := h(m); err != nil || out != nil {
		t.Fatal(out, err)
	}
	m.Ack()
	waitFor(t, "the recorded rejection", func() bool { return mw.Stats().Completed == 1 })
	c, err := store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: "reject"}, "", time.Second)
	if err != nil || c.Outcome != dedup.Duplicate || string(c.Result) != "rejected" {
		t.Fatalf("%+v %v", c, err)
	}
	if _, err := h(message.NewMessage("timeout", nil)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("the panic was swallowed")
			}
		}()
		h(message.NewMessage("panic", nil))
	}()
	for _, id := range []string{"timeout", "panic"} {
		if _, err := h(message.NewMessage(id, nil)); !errors.Is(err, dedupwatermill.ErrInProgress) {
			t.Fatalf("%s: the claim was not kept: %v", id, err)
		}
	}
	if s := mw.Stats(); s.Kept != 2 || s.Released != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// countingExtender counts the store's Extend calls.
type countingExtender struct {
	dedup.Store
	extends atomic.Int64
}

func (c *countingExtender) Extend(ctx context.Context, cl dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	c.extends.Add(1)
	return c.Store.(dedup.Extender).Extend(ctx, cl, lease)
}

// The heartbeat extends the lease while the handler runs and while the
// router has not acked yet, and stops when the message is acked.
func TestHeartbeat(t *testing.T) {
	ms, _ := memstore.New()
	store := &countingExtender{Store: ms}
	mw := newMiddleware(t, store, dedupwatermill.WithLease(time.Minute), dedupwatermill.WithHeartbeat(time.Millisecond))
	h := mw.Middleware(func(*message.Message) ([]*message.Message, error) {
		for store.extends.Load() < 3 {
			time.Sleep(time.Millisecond)
		}
		return nil, nil
	})
	m := message.NewMessage("m-1", nil)
	if _, err := h(m); err != nil {
		t.Fatal(err)
	}
	during := store.extends.Load()
	waitFor(t, "extensions after the handler, before the ack", func() bool { return store.extends.Load() >= during+2 })
	m.Ack()
	waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
	mw.Close()
	after := store.extends.Load()
	if _, err := ms.Extend(context.Background(), dedup.Claim{Key: dedup.Key{Scope: "orders", ID: "m-1"}, Outcome: dedup.Acquired, Token: dedup.NewToken()}, time.Minute); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("extend of a completed key: %v", err)
	}
	if store.extends.Load() != after {
		t.Fatal("the heartbeat went on after Close")
	}
}

// Bad options are refused by New with a typed error.
func TestOptions(t *testing.T) {
	s, _ := memstore.New()
	for name, opts := range map[string][]dedupwatermill.Option{
		"lease":     {dedupwatermill.WithLease(0)},
		"retention": {dedupwatermill.WithRetention(-time.Second)},
		"heartbeat": {dedupwatermill.WithLease(time.Second), dedupwatermill.WithHeartbeat(time.Second)},
		"key":       {dedupwatermill.WithMetadataKey("")},
		"classify":  {dedupwatermill.WithClassifier(nil)},
		"tries":     {dedupwatermill.WithCompleteAttempts(0)},
		"poll":      {dedupwatermill.WithAckPollInterval(0)},
	} {
		if _, err := dedupwatermill.New(s, "orders", opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := dedupwatermill.New(nil, "orders"); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Error(err)
	}
	if _, err := dedupwatermill.New(s, ""); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Error(err)
	}
}

// When a heartbeat finds the lease taken over, the handler's context is
// cancelled with cause ErrLeaseLost and nothing is completed.
func TestHeartbeatLeaseLost(t *testing.T) {
	clock := storetest.NewClock()
	store, _ := memstore.New(memstore.WithClock(clock))
	mw := newMiddleware(t, store, dedupwatermill.WithLease(time.Minute), dedupwatermill.WithHeartbeat(time.Millisecond))
	var cause error
	h := mw.Middleware(func(m *message.Message) ([]*message.Message, error) {
		clock.Advance(2 * time.Minute) // the lease runs out between two beats...
		c, err := store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: m.UUID}, "", time.Hour)
		if err != nil || !c.TakenOver {
			return nil, fmt.Errorf("take-over: %+v %v", c, err)
		}
		<-m.Context().Done() // ...and the next beat finds it lost
		cause = context.Cause(m.Context())
		return nil, nil
	})
	m := message.NewMessage("m-1", nil)
	if _, err := h(m); err != nil {
		t.Fatal(err)
	}
	m.Ack()
	if !errors.Is(cause, dedup.ErrLeaseLost) {
		t.Fatalf("cause %v", cause)
	}
	mw.Close()
	if s := mw.Stats(); s.LeaseLost != 1 || s.Completed != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// A handler that fails under a heartbeat gets its message's context back
// uncancelled, so that Retry's next try claims and runs again.
func TestHeartbeatRetryAfterFailure(t *testing.T) {
	store, _ := memstore.New()
	mw := newMiddleware(t, store, dedupwatermill.WithLease(time.Minute), dedupwatermill.WithHeartbeat(time.Millisecond))
	var calls atomic.Int64
	h := mw.Middleware(func(m *message.Message) ([]*message.Message, error) {
		if calls.Add(1) == 1 {
			return nil, errors.New("transient")
		}
		return nil, m.Context().Err()
	})
	m := message.NewMessage("m-1", nil)
	if _, err := h(m); err == nil {
		t.Fatal("the first try succeeded")
	}
	if m.Context().Err() != nil {
		t.Fatalf("the message's context is left cancelled: %v", m.Context().Err())
	}
	if _, err := h(m); err != nil {
		t.Fatal(err)
	}
	m.Ack()
	waitFor(t, "completion", func() bool { return mw.Stats().Completed == 1 })
	if s := mw.Stats(); s.Released != 1 || s.Acquired != 2 {
		t.Fatalf("stats %+v", s)
	}
}

// TestClaimFromHandler: the handler's context carries the claim it runs
// under (key, token, attempt, lease), the one the store issued: Extend
// with it succeeds; outside a handler there is none.
func TestClaimFromHandler(t *testing.T) {
	ctx := context.Background()
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	mw := newMiddleware(t, store)
	var got dedup.Claim
	var ok bool
	h := mw.Middleware(func(m *message.Message) ([]*message.Message, error) {
		got, ok = dedupwatermill.ClaimFrom(m.Context())
		return nil, nil
	})
	m := message.NewMessage("claim-from-1", []byte("p"))
	if _, err := h(m); err != nil {
		t.Fatal(err)
	}
	if !ok || got.Outcome != dedup.Acquired || got.Key.ID != "claim-from-1" || got.Token.IsZero() || got.Attempt != 1 || got.TakenOver || got.LeaseUntil.IsZero() {
		t.Fatalf("ClaimFrom in the handler = %+v, %v", got, ok)
	}
	if _, err := store.Extend(ctx, got, time.Minute); err != nil {
		t.Fatalf("Extend with the handler's claim: %v (not the store's token)", err)
	}
	m.Ack()
	if _, ok := dedupwatermill.ClaimFrom(ctx); ok {
		t.Fatal("ClaimFrom outside a handler found a claim")
	}
}
