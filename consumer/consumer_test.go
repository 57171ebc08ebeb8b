package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// effects counts handler runs per message ID.
type effects struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *effects) add(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = make(map[string]int)
	}
	e.n[id]++
}

func (e *effects) get(id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[id]
}

type fixture struct {
	clock *storetest.Clock
	store *memstore.Store
	dlq   *consumer.MemoryDLQ
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	clock := storetest.NewClock()
	s, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return &fixture{clock: clock, store: s, dlq: &consumer.MemoryDLQ{}}
}

func (f *fixture) processor(t *testing.T, h consumer.Handler, opts ...consumer.Option) *consumer.Processor {
	t.Helper()
	opts = append([]consumer.Option{consumer.WithDeadLetter(f.dlq), consumer.WithClock(f.clock)}, opts...)
	p, err := consumer.New("orders", f.store, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func msg(id string) *consumer.Message {
	return &consumer.Message{ID: id, Subject: "orders.created", Payload: []byte(`{"order":"` + id + `"}`), Headers: map[string]string{"h": "v"}}
}

func want(t *testing.T, d consumer.Decision, a consumer.Action) {
	t.Helper()
	if d.Action != a {
		t.Fatalf("decision %v (class %v, err %v), want %v", d.Action, d.Class, d.Err, a)
	}
}

func TestSameMessageSequentiallyIsAppliedOnce(t *testing.T) {
	f := newFixture(t)
	var fx effects
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		fx.add(m.ID)
		return []byte("ok:" + m.ID), nil
	})
	ctx := context.Background()
	d := p.Process(ctx, msg("m1"))
	want(t, d, consumer.Ack)
	if d.Duplicate || string(d.Result) != "ok:m1" {
		t.Fatalf("first decision %+v", d)
	}
	for range 3 {
		d = p.Process(ctx, msg("m1"))
		want(t, d, consumer.Ack)
		if !d.Duplicate || string(d.Result) != "ok:m1" {
			t.Fatalf("redelivery decision %+v, want a duplicate with the stored result", d)
		}
	}
	if n := fx.get("m1"); n != 1 {
		t.Fatalf("%d effects, want 1", n)
	}
	if s := p.Stats(); s.Applied != 1 || s.Duplicates != 3 {
		t.Fatalf("stats %+v", s)
	}
}

func TestConcurrentDeliveriesOfOneMessageApplyOnce(t *testing.T) {
	f := newFixture(t)
	var fx effects
	release := make(chan struct{})
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		fx.add(m.ID)
		<-release
		return nil, nil
	})
	const n = 64
	var wg sync.WaitGroup
	var acks, retries atomic.Int64
	for range n {
		wg.Go(func() {
			for {
				d := p.Process(context.Background(), msg("one"))
				if d.Action == consumer.Ack {
					acks.Add(1)
					return
				}
				if d.Action != consumer.Retry {
					t.Errorf("decision %v", d.Action)
					return
				}
				retries.Add(1)
				time.Sleep(time.Millisecond)
			}
		})
	}
	time.Sleep(20 * time.Millisecond)
	close(release)
	wg.Wait()
	if got := fx.get("one"); got != 1 {
		t.Fatalf("%d effects from %d concurrent deliveries, want 1", got, n)
	}
	if acks.Load() != n {
		t.Fatalf("%d acks, want %d", acks.Load(), n)
	}
	if p.Stats().InProgress == 0 {
		t.Fatal("no delivery saw the key in progress: the test did not overlap")
	}
}

func TestBusinessKeyDedupsAcrossMessageIDs(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}, consumer.WithBusinessKey())
	a, b := msg("id-1"), msg("id-2")
	a.BusinessKey, b.BusinessKey = "payment-77", "payment-77"
	want(t, p.Process(context.Background(), a), consumer.Ack)
	d := p.Process(context.Background(), b)
	want(t, d, consumer.Ack)
	if !d.Duplicate || runs.Load() != 1 {
		t.Fatalf("second message id with the same business key: duplicate=%v, %d runs, want a duplicate and 1 run", d.Duplicate, runs.Load())
	}
}

func TestTransientFailureRetriesWithJitteredBackoff(t *testing.T) {
	f := newFixture(t)
	var fails atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if fails.Add(1) <= 3 {
			return nil, consumer.Transient(errors.New("connection refused"))
		}
		return nil, nil
	}, consumer.WithBackoff(100*time.Millisecond, time.Second))
	for i := 1; i <= 3; i++ {
		d := p.Process(context.Background(), msg("t"))
		want(t, d, consumer.Retry)
		ceil := min(time.Second, 100*time.Millisecond<<(i-1))
		if d.Class != consumer.ClassTransient || d.Attempt != i || d.Delay < 25*time.Millisecond || d.Delay >= ceil {
			t.Fatalf("retry %d: class %v attempt %d delay %v, want transient, attempt %d, delay in [25ms, %v)", i, d.Class, d.Attempt, d.Delay, i, ceil)
		}
	}
	want(t, p.Process(context.Background(), msg("t")), consumer.Ack)
	if f.dlq.Len() != 0 {
		t.Fatal("a message that recovered was dead-lettered")
	}
}

func TestBackoffStaysWithinBounds(t *testing.T) {
	base, maxd := 10*time.Millisecond, 5*time.Second
	for n := -1; n < 80; n++ {
		ceil := maxd
		if n >= 1 && n < 20 {
			ceil = min(maxd, base<<(n-1))
		}
		if n < 1 {
			ceil = base
		}
		var sum time.Duration
		for range 200 {
			d := consumer.Backoff(base, maxd, n)
			if d < base/4 || d >= ceil && ceil > base/4 {
				t.Fatalf("Backoff(n=%d) = %v, want in [%v, %v)", n, d, base/4, ceil)
			}
			sum += d
		}
		if ceil > base && sum/200 < ceil/8 {
			t.Fatalf("Backoff(n=%d) mean %v: not spread over [%v, %v)", n, sum/200, base/4, ceil)
		}
	}
}

func TestPermanentFailureIsDeadLetteredAfterItsLimit(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, consumer.Permanent(fmt.Errorf("schema v9 unknown"))
	})
	m := msg("poison")
	m.BusinessKey = "order-9"
	start := f.clock.Now()
	for i := 1; i <= 2; i++ {
		d := p.Process(context.Background(), m)
		want(t, d, consumer.Retry)
		f.clock.Advance(time.Second)
	}
	d := p.Process(context.Background(), m)
	want(t, d, consumer.DeadLettered)
	if !d.Acknowledge() || d.Attempt != 3 {
		t.Fatalf("dead letter decision %+v", d)
	}
	recs, err := f.dlq.List(context.Background(), "", 10)
	if err != nil || len(recs) != 1 {
		t.Fatalf("dlq: %v, %d records", err, len(recs))
	}
	r := recs[0]
	if r.Consumer != "orders" || r.Key != (dedup.Key{Scope: "orders", ID: "poison"}) || r.Class != consumer.ClassPermanent ||
		r.Attempts != 3 || r.Reason != "schema v9 unknown" || r.Message.ID != "poison" || r.Message.BusinessKey != "order-9" ||
		string(r.Message.Payload) != string(m.Payload) || r.Message.Headers["h"] != "v" || r.Message.Subject != m.Subject {
		t.Fatalf("dead letter %+v", r)
	}
	if !r.FirstFailure.Equal(start) || !r.LastFailure.Equal(start.Add(2*time.Second)) {
		t.Fatalf("failure times %v..%v, want %v..%v", r.FirstFailure, r.LastFailure, start, start.Add(2*time.Second))
	}
	// The claim was released: a replay with the original ID applies.
	c, err := f.store.Claim(context.Background(), r.Key, "", time.Second)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("after the dead letter the key is %v (%v), want acquirable", c.Outcome, err)
	}
}

func TestUnclassifiedErrorsHaveTheirOwnLimit(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, errors.New("boom")
	}, consumer.WithLimits(consumer.Limits{Unclassified: 4}))
	for i := 1; i < 4; i++ {
		d := p.Process(context.Background(), msg("u"))
		want(t, d, consumer.Retry)
		if d.Class != consumer.Unclassified {
			t.Fatalf("class %v", d.Class)
		}
	}
	want(t, p.Process(context.Background(), msg("u")), consumer.DeadLettered)
}

func TestPanicIsCountedAsPermanentAndReleasesTheClaim(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		panic("nil map")
	})
	d := p.Process(context.Background(), msg("p"))
	want(t, d, consumer.Retry)
	if d.Class != consumer.ClassPermanent || !strings.Contains(d.Err.Error(), "nil map") {
		t.Fatalf("panic decision %+v", d)
	}
	want(t, p.Process(context.Background(), msg("p")), consumer.Retry)
	want(t, p.Process(context.Background(), msg("p")), consumer.DeadLettered)
	c, err := f.store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: "p"}, "", time.Second)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("after panics the key is %v (%v), want released", c.Outcome, err)
	}
}

func TestBusinessRejectionIsRecordedAndNotRetried(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, consumer.Reject(errors.New("insufficient funds"), []byte(`{"status":"declined"}`))
	})
	d := p.Process(context.Background(), msg("r"))
	want(t, d, consumer.Rejected)
	if !d.Acknowledge() || string(d.Result) != `{"status":"declined"}` || d.Class != consumer.ClassBusiness {
		t.Fatalf("rejection %+v", d)
	}
	d = p.Process(context.Background(), msg("r"))
	want(t, d, consumer.Ack)
	if !d.Duplicate || string(d.Result) != `{"status":"declined"}` || runs.Load() != 1 {
		t.Fatalf("redelivery of a rejection: %+v, %d runs", d, runs.Load())
	}
	if f.dlq.Len() != 0 {
		t.Fatal("a business rejection was dead-lettered")
	}
}

func TestUnknownOutcomeReconciledAsAppliedIsNotRunAgain(t *testing.T) {
	f := newFixture(t)
	var runs, asked atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, consumer.Unknown(context.DeadlineExceeded)
	}, consumer.WithReconciler(func(ctx context.Context, key dedup.Key, m *consumer.Message) (consumer.Reconciled, error) {
		asked.Add(1)
		if key.ID != m.ID {
			t.Errorf("reconciled key %v for message %s", key, m.ID)
		}
		return consumer.Reconciled{Applied: true, Result: []byte("charge ch_1")}, nil
	}))
	d := p.Process(context.Background(), msg("pay"))
	want(t, d, consumer.Ack)
	if string(d.Result) != "charge ch_1" || asked.Load() != 1 || p.Stats().Reconciled != 1 {
		t.Fatalf("decision %+v, reconciler asked %d times", d, asked.Load())
	}
	d = p.Process(context.Background(), msg("pay"))
	if !d.Duplicate || runs.Load() != 1 {
		t.Fatalf("redelivery %+v after %d runs, want a duplicate after 1", d, runs.Load())
	}
}

func TestUnknownOutcomeIsReconciledBeforeTheRetry(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	var applied atomic.Bool   // what the provider knows
	var reachable atomic.Bool // whether the provider answers lookups
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		applied.Store(true) // the charge went through, but the answer was lost
		return nil, consumer.Unknown(errors.New("provider timeout"))
	}, consumer.WithLease(10*time.Second), consumer.WithReconciler(func(ctx context.Context, key dedup.Key, m *consumer.Message) (consumer.Reconciled, error) {
		if !reachable.Load() {
			return consumer.Reconciled{}, errors.New("provider lookup unavailable")
		}
		return consumer.Reconciled{Applied: applied.Load()}, nil
	}))
	d := p.Process(context.Background(), msg("pay"))
	want(t, d, consumer.Retry)
	if d.Class != consumer.ClassUnknown || d.Delay < 10*time.Second {
		t.Fatalf("unknown outcome: %+v, want a retry after the lease", d)
	}
	// Within the lease the claim is kept: another delivery must not run.
	want(t, p.Process(context.Background(), msg("pay")), consumer.Retry)
	f.clock.Advance(11 * time.Second)
	reachable.Store(true)
	d = p.Process(context.Background(), msg("pay"))
	want(t, d, consumer.Ack)
	if runs.Load() != 1 {
		t.Fatalf("handler ran %d times, want 1: the take-over must reconcile first", runs.Load())
	}
}

func TestUnknownOutcomeWithoutReconcilerTellsTheHandler(t *testing.T) {
	f := newFixture(t)
	var takenOver []bool
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		takenOver = append(takenOver, d.TakenOver)
		if len(takenOver) == 1 {
			return nil, consumer.Unknown(errors.New("timeout"))
		}
		return nil, nil
	}, consumer.WithLease(time.Second))
	want(t, p.Process(context.Background(), msg("x")), consumer.Retry)
	f.clock.Advance(2 * time.Second)
	want(t, p.Process(context.Background(), msg("x")), consumer.Ack)
	if len(takenOver) != 2 || takenOver[0] || !takenOver[1] {
		t.Fatalf("TakenOver per attempt %v, want [false true]", takenOver)
	}
}

// downStore fails every call like an unreachable server.
type downStore struct{ dedup.Store }

func (downStore) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, l time.Duration) (dedup.Claim, error) {
	return dedup.Claim{}, &dedup.StoreError{Store: "down", Op: "claim", Err: errors.New("connection refused"), NotApplied: true}
}

func TestStoreDownFailsClosedAndIsNotAnAttempt(t *testing.T) {
	dlq := &consumer.MemoryDLQ{}
	var runs atomic.Int64
	p, err := consumer.New("orders", downStore{}, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}, consumer.WithDeadLetter(dlq))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		m := msg("m")
		m.Delivery = i + 1
		d := p.Process(context.Background(), m)
		want(t, d, consumer.Retry)
		if !dedup.IsStoreError(d.Err) {
			t.Fatalf("retry error %v, want the store error", d.Err)
		}
	}
	if runs.Load() != 0 || dlq.Len() != 0 || p.Stats().StoreErrors != 50 {
		t.Fatalf("store down: %d runs, %d dead letters, stats %+v; want no run, no dead letter", runs.Load(), dlq.Len(), p.Stats())
	}
}

// flakySink fails until it is fixed.
type flakySink struct {
	consumer.MemoryDLQ
	broken atomic.Bool
}

func (s *flakySink) DeadLetter(ctx context.Context, dl consumer.DeadLetter) error {
	if s.broken.Load() {
		return errors.New("dlq stream unavailable")
	}
	return s.MemoryDLQ.DeadLetter(ctx, dl)
}

func TestDeadLetterSinkFailureKeepsTheMessage(t *testing.T) {
	f := newFixture(t)
	sink := &flakySink{}
	sink.broken.Store(true)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, consumer.Permanent(errors.New("corrupt"))
	}, consumer.WithDeadLetter(sink), consumer.WithLimits(consumer.Limits{Permanent: 1}))
	d := p.Process(context.Background(), msg("c"))
	want(t, d, consumer.Retry)
	if d.Acknowledge() || !strings.Contains(d.Err.Error(), "dlq stream unavailable") {
		t.Fatalf("sink failure decision %+v", d)
	}
	sink.broken.Store(false)
	want(t, p.Process(context.Background(), msg("c")), consumer.DeadLettered)
	if sink.Len() != 1 {
		t.Fatalf("%d dead letters, want 1", sink.Len())
	}
}

func TestInvalidKeyIsDeadLetteredAtOnce(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	})
	for _, id := range []string{"", strings.Repeat("x", dedup.MaxIDBytes+1), "bad\x00id"} {
		d := p.Process(context.Background(), msg(id))
		want(t, d, consumer.DeadLettered)
		if !errors.Is(d.Err, dedup.ErrInvalidArgument) || !strings.Contains(d.Err.Error(), "dedup key") {
			t.Fatalf("id %q: error %v, want an invalid-argument error naming the key", id, d.Err)
		}
	}
	if runs.Load() != 0 || f.dlq.Len() != 3 {
		t.Fatalf("%d runs, %d dead letters; want 0 and 3", runs.Load(), f.dlq.Len())
	}
}

func TestFingerprintConflictIsDeadLettered(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}, consumer.WithPayloadFingerprint())
	want(t, p.Process(context.Background(), msg("f")), consumer.Ack)
	other := msg("f")
	other.Payload = []byte(`{"order":"someone else"}`)
	d := p.Process(context.Background(), other)
	want(t, d, consumer.DeadLettered)
	if !errors.Is(d.Err, dedup.ErrFingerprintMismatch) || runs.Load() != 1 {
		t.Fatalf("conflict: %v after %d runs", d.Err, runs.Load())
	}
	if d := p.Process(context.Background(), msg("f")); !d.Duplicate {
		t.Fatalf("the original payload again: %+v, want a duplicate", d)
	}
}

func TestMaxDeliveriesDeadLettersWithoutRunning(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	}, consumer.WithMaxDeliveries(5))
	m := msg("crashy")
	m.Delivery = 6
	d := p.Process(context.Background(), m)
	want(t, d, consumer.DeadLettered)
	if runs.Load() != 0 || !strings.Contains(d.Err.Error(), "delivered 6 times") {
		t.Fatalf("%d runs, err %v", runs.Load(), d.Err)
	}
}

func TestGiveUpDeadLettersARetryTheBrokerWillNotRedeliver(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, consumer.Transient(errors.New("timeout"))
	})
	m := msg("last")
	m.Delivery = 7
	d := p.Process(context.Background(), m)
	want(t, d, consumer.Retry)
	d = p.GiveUp(context.Background(), m, d)
	want(t, d, consumer.DeadLettered)
	recs, _ := f.dlq.List(context.Background(), "", 0)
	if len(recs) != 1 || recs[0].Class != consumer.ClassTransient || !strings.Contains(recs[0].Reason, "will not redeliver") {
		t.Fatalf("records %+v", recs)
	}
}

func TestDeadLetterReasonIsOneBoundedLine(t *testing.T) {
	f := newFixture(t)
	long := strings.Repeat("é", 400) + "\nline two\ttab"
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, consumer.Permanent(errors.New(long))
	}, consumer.WithLimits(consumer.Limits{Permanent: 1}))
	want(t, p.Process(context.Background(), msg("r")), consumer.DeadLettered)
	recs, _ := f.dlq.List(context.Background(), "", 0)
	r := recs[0].Reason
	if len(r) > 515 || strings.ContainsAny(r, "\n\t") || !utf8.ValidString(r) || !strings.HasSuffix(r, "...") {
		t.Fatalf("reason %d bytes %q", len(r), r)
	}
}

func TestNewRejectsBadConfiguration(t *testing.T) {
	s, _ := memstore.New()
	defer s.Close()
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) { return nil, nil }
	dlq := consumer.WithDeadLetter(&consumer.MemoryDLQ{})
	cases := map[string]func() error{
		"no sink":  func() error { _, err := consumer.New("c", s, h); return err },
		"no name":  func() error { _, err := consumer.New("", s, h, dlq); return err },
		"no store": func() error { _, err := consumer.New("c", nil, h, dlq); return err },
		"no handler": func() error {
			_, err := consumer.New("c", s, nil, dlq)
			return err
		},
		"backoff": func() error {
			_, err := consumer.New("c", s, h, dlq, consumer.WithBackoff(time.Second, time.Millisecond))
			return err
		},
		"lease": func() error { _, err := consumer.New("c", s, h, dlq, consumer.WithLease(-1)); return err },
		"scope": func() error {
			_, err := consumer.New("c", s, h, dlq, consumer.WithScope(strings.Repeat("s", 300)))
			return err
		},
	}
	for name, f := range cases {
		if err := f(); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want an invalid-argument error", name, err)
		}
	}
}

func TestCancelledDeliveryIsNotAnAttempt(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}, consumer.WithLimits(consumer.Limits{Unclassified: 1}))
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d := p.Process(ctx, msg("shutdown"))
	want(t, d, consumer.Retry)
	if f.dlq.Len() != 0 || d.Attempt != 0 {
		t.Fatalf("a delivery cancelled by shutdown counted as attempt %d (%d dead letters)", d.Attempt, f.dlq.Len())
	}
	// The claim was released on a detached context: the next delivery runs.
	c, err := f.store.Claim(context.Background(), dedup.Key{Scope: "orders", ID: "shutdown"}, "", time.Second)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("after the cancelled delivery the key is %v (%v), want released", c.Outcome, err)
	}
}

func TestQuarantineDeadLettersWithItsOwnReasonAndKey(t *testing.T) {
	f := newFixture(t)
	var runs atomic.Int64
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs.Add(1)
		return nil, nil
	})
	d := p.Quarantine(context.Background(), msg("q1"), consumer.ClassPermanent, errors.New(`header Dedup-Version: "x" is not a number`))
	want(t, d, consumer.DeadLettered)
	recs, _ := f.dlq.List(context.Background(), "", 0)
	if runs.Load() != 0 || len(recs) != 1 || recs[0].Key != (dedup.Key{Scope: "orders", ID: "q1"}) ||
		!strings.Contains(recs[0].Reason, "Dedup-Version") || strings.Contains(recs[0].Reason, "redeliver") {
		t.Fatalf("%d runs, records %+v", runs.Load(), recs)
	}
}
