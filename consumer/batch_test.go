package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
)

// mixed is a processor whose handler behaves by message ID, with every
// observable recorded: effects, hook events, observer calls.
type mixed struct {
	*fixture
	p        *consumer.Processor
	fx       effects
	mu       sync.Mutex
	events   []string // hook events, "op key"
	observed []string // observer calls, "id action"
}

func newMixed(t *testing.T, opts ...consumer.Option) *mixed {
	t.Helper()
	x := &mixed{fixture: newFixture(t)}
	hook := dedup.HookFunc(func(_ context.Context, e any) {
		x.mu.Lock()
		defer x.mu.Unlock()
		switch e := e.(type) {
		case dedup.ClaimEvent:
			x.events = append(x.events, fmt.Sprintf("claim %s %v %v", e.Key.ID, e.Outcome, e.Err != nil))
		case dedup.FinishEvent:
			x.events = append(x.events, fmt.Sprintf("%s %s %v", e.Op, e.Key.ID, e.Err))
		}
	})
	base := []consumer.Option{
		consumer.WithLimits(consumer.Limits{Permanent: 3}),
		consumer.WithRunnerOptions(dedup.WithHooks(hook)),
		consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
			x.mu.Lock()
			defer x.mu.Unlock()
			x.observed = append(x.observed, m.ID+" "+d.Action.String())
		}),
		consumer.WithReconciler(func(ctx context.Context, key dedup.Key, m *consumer.Message) (consumer.Reconciled, error) {
			if key.ID == "unknown" {
				return consumer.Reconciled{Applied: true, Result: []byte("reconciled")}, nil
			}
			return consumer.Reconciled{}, errors.New("provider lookup unavailable")
		}),
	}
	x.p = x.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		switch {
		case strings.HasPrefix(m.ID, "transient"):
			return nil, consumer.Transient(fmt.Errorf("connection refused (attempt %d)", d.Attempt))
		case m.ID == "perm":
			return nil, consumer.Permanent(errors.New("schema v9 unknown"))
		case m.ID == "reject":
			return nil, consumer.Reject(errors.New("insufficient funds"), []byte("declined"))
		case strings.HasPrefix(m.ID, "unknown"):
			return nil, consumer.Unknown(errors.New("provider timeout"))
		case m.ID == "boom":
			panic("nil map")
		}
		x.fx.add(m.ID)
		return []byte("ok:" + m.ID), nil
	}, append(base, opts...)...)
	return x
}

// prepare brings the fixture to the state the mixed batch expects: "dup"
// completed, "perm" failed twice, "held" claimed by another consumer.
func (x *mixed) prepare(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	want(t, x.p.Process(ctx, msg("dup")), consumer.Ack)
	want(t, x.p.Process(ctx, msg("perm")), consumer.Retry)
	want(t, x.p.Process(ctx, msg("perm")), consumer.Retry)
	if c, err := x.store.Claim(ctx, dedup.Key{Scope: "orders", ID: "held"}, "", time.Minute); err != nil || c.Outcome != dedup.Acquired {
		t.Fatal(c.Outcome, err)
	}
	x.mu.Lock()
	x.events, x.observed = nil, nil
	x.mu.Unlock()
}

func msgs(ids ...string) []*consumer.Message {
	ms := make([]*consumer.Message, len(ids))
	for i, id := range ids {
		ms[i] = msg(id)
	}
	return ms
}

// sameDecision fails the test unless a and b are the same decision. Delays
// drawn with jitter are only checked to be positive.
func sameDecision(t *testing.T, what string, a, b consumer.Decision) {
	t.Helper()
	errText := func(err error) string {
		if err == nil {
			return ""
		}
		return err.Error()
	}
	if a.Action != b.Action || a.Key != b.Key || a.Duplicate != b.Duplicate || string(a.Result) != string(b.Result) ||
		a.Class != b.Class || a.Attempt != b.Attempt || errText(a.Err) != errText(b.Err) {
		t.Errorf("%s: Process decided %+v, ProcessBatch %+v", what, a, b)
		return
	}
	jitter := a.Action == consumer.Retry && !errors.Is(a.Err, dedup.ErrInProgress) && a.Class != consumer.ClassUnknown
	if (jitter && (a.Delay <= 0 || b.Delay <= 0)) || (!jitter && a.Delay != b.Delay) {
		t.Errorf("%s: delays %v and %v", what, a.Delay, b.Delay)
	}
}

// TestProcessBatchDecidesAsProcess runs one mixed batch through Process,
// message by message, and through ProcessBatch, each on its own store in
// the same state, and compares everything a caller can see.
func TestProcessBatchDecidesAsProcess(t *testing.T) {
	ids := []string{
		"new", "dup", "transient", "perm", "reject", "unknown", "unknown-kept", "", "held",
		"new",       // repeated in the batch: a duplicate after it
		"transient", // repeated after a failure: runs again, attempt 2
		"other",
	}
	seq, bat := newMixed(t), newMixed(t)
	seq.prepare(t)
	bat.prepare(t)
	ctx := context.Background()
	var want []consumer.Decision
	for _, m := range msgs(ids...) {
		want = append(want, seq.p.Process(ctx, m))
	}
	got := bat.p.ProcessBatch(ctx, msgs(ids...))
	if len(got) != len(want) {
		t.Fatalf("%d decisions for %d messages", len(got), len(ids))
	}
	for i := range want {
		sameDecision(t, fmt.Sprintf("message %d (%q)", i, ids[i]), want[i], got[i])
	}
	// The decisions are the interesting ones.
	for i, a := range []consumer.Action{consumer.Ack, consumer.Ack, consumer.Retry, consumer.DeadLettered, consumer.Rejected,
		consumer.Ack, consumer.Retry, consumer.DeadLettered, consumer.Retry, consumer.Ack, consumer.Retry, consumer.Ack} {
		if got[i].Action != a {
			t.Errorf("message %d (%q): %v, want %v", i, ids[i], got[i].Action, a)
		}
	}
	if !got[9].Duplicate || got[10].Attempt != 2 {
		t.Errorf("repeated keys: %+v and %+v, want a duplicate and a second attempt", got[9], got[10])
	}

	if s, b := seq.p.Stats(), bat.p.Stats(); s != b {
		t.Errorf("stats: Process %+v, ProcessBatch %+v", s, b)
	}
	for _, id := range []string{"new", "other", "dup"} {
		if seq.fx.get(id) != bat.fx.get(id) {
			t.Errorf("%s applied %d times by Process, %d by ProcessBatch", id, seq.fx.get(id), bat.fx.get(id))
		}
	}
	if strings.Join(seq.observed, ", ") != strings.Join(bat.observed, ", ") {
		t.Errorf("observer calls:\n Process      %v\n ProcessBatch %v", seq.observed, bat.observed)
	}
	if a, b := countEvents(seq.events), countEvents(bat.events); a != b {
		t.Errorf("hook events:\n Process      %v\n ProcessBatch %v", seq.events, bat.events)
	}
	dl := func(f *fixture) string {
		recs, _ := f.dlq.List(ctx, "", 0)
		var b strings.Builder
		for _, r := range recs {
			fmt.Fprintf(&b, "%s %v %d %s; ", r.Key.ID, r.Class, r.Attempts, r.Reason)
		}
		return b.String()
	}
	if a, b := dl(seq.fixture), dl(bat.fixture); a != b || a == "" {
		t.Errorf("dead letters:\n Process      %s\n ProcessBatch %s", a, b)
	}
	// The stores end in the same state.
	for _, id := range []string{"new", "dup", "transient", "perm", "reject", "unknown", "unknown-kept", "held", "other"} {
		k := dedup.Key{Scope: "orders", ID: id}
		a, _ := seq.store.Claim(ctx, k, "", time.Minute)
		b, _ := bat.store.Claim(ctx, k, "", time.Minute)
		if a.Outcome != b.Outcome || string(a.Result) != string(b.Result) {
			t.Errorf("%s after the batch: %v %q with Process, %v %q with ProcessBatch", id, a.Outcome, a.Result, b.Outcome, b.Result)
		}
	}
}

// countEvents counts hook events by their text, order aside.
func countEvents(evs []string) string {
	n := map[string]int{}
	for _, e := range evs {
		n[e]++
	}
	return fmt.Sprint(n)
}

// TestProcessBatchPanicReleasesWhatIsNotRun: a panic releases the claim
// of its message and of every message not yet run; the panic is a
// permanent failure as in Process, the messages after it are processed
// one at a time, and the successes before it are completed.
func TestProcessBatchPanicReleasesWhatIsNotRun(t *testing.T) {
	seq, bat := newMixed(t), newMixed(t)
	ids := []string{"a", "boom", "b", "c"}
	ctx := context.Background()
	var want []consumer.Decision
	for _, m := range msgs(ids...) {
		want = append(want, seq.p.Process(ctx, m))
	}
	got := bat.p.ProcessBatch(ctx, msgs(ids...))
	for i := range want {
		sameDecision(t, ids[i], want[i], got[i])
	}
	if got[1].Action != consumer.Retry || got[1].Class != consumer.ClassPermanent || !strings.Contains(got[1].Err.Error(), "nil map") {
		t.Fatalf("the panic decided %+v", got[1])
	}
	for _, id := range []string{"a", "b", "c"} {
		if bat.fx.get(id) != 1 {
			t.Errorf("%s applied %d times, want 1", id, bat.fx.get(id))
		}
	}
	released := map[string]bool{}
	for _, e := range bat.events {
		if id, ok := strings.CutPrefix(e, "release "); ok {
			released[strings.Fields(id)[0]] = true
		}
	}
	if !released["boom"] || !released["b"] || !released["c"] || released["a"] {
		t.Errorf("released %v, want boom, b and c (not yet run), not a (run before)", released)
	}
	c, err := bat.store.Claim(ctx, dedup.Key{Scope: "orders", ID: "boom"}, "", time.Second)
	if err != nil || c.Outcome != dedup.Acquired {
		t.Fatalf("after the panic the key is %v (%v), want released", c.Outcome, err)
	}
}

// TestProcessBatchConcurrentOverlappingKeys: 8 goroutines each process a
// 64-message batch at once, the batches overlapping in their keys (and
// repeating some inside a batch); each redelivers its Retry decisions
// until everything is acknowledged. Every key is applied exactly once.
func TestProcessBatchConcurrentOverlappingKeys(t *testing.T) {
	f := newFixture(t)
	var fx effects
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		fx.add(m.ID)
		time.Sleep(20 * time.Microsecond) // hold the claim while other batches arrive
		return []byte("done " + m.ID), nil
	}, consumer.WithBackoff(time.Millisecond, 5*time.Millisecond))
	const workers, size, keys = 8, 64, 128
	var acks atomic.Int64
	var start, wg sync.WaitGroup
	start.Add(1)
	for w := range workers {
		wg.Go(func() {
			batch := make([]*consumer.Message, size)
			for j := range batch {
				k := (w*16 + j) % keys
				if j%10 == 9 {
					k = (w*16 + j - 1) % keys // repeated inside the batch
				}
				batch[j] = msg(fmt.Sprint("k", k))
			}
			start.Wait()
			for round := 0; len(batch) > 0; round++ {
				if round == 1000 {
					t.Errorf("worker %d: %d messages still retried after 1000 rounds", w, len(batch))
					return
				}
				var again []*consumer.Message
				for i, d := range p.ProcessBatch(context.Background(), batch) {
					switch d.Action {
					case consumer.Ack:
						acks.Add(1)
						if string(d.Result) != "done "+batch[i].ID {
							t.Errorf("%s acknowledged with result %q", batch[i].ID, d.Result)
						}
					case consumer.Retry:
						again = append(again, batch[i])
					default:
						t.Errorf("%s: %v (%v)", batch[i].ID, d.Action, d.Err)
					}
				}
				batch = again
				time.Sleep(time.Millisecond)
			}
		})
	}
	start.Done()
	wg.Wait()
	for k := range keys {
		id := fmt.Sprint("k", k)
		if n := fx.get(id); n != 1 {
			t.Errorf("%s applied %d times, want exactly once", id, n)
		}
	}
	s := p.Stats()
	if acks.Load() != workers*size || s.Applied != keys || s.Duplicates != workers*size-keys || f.dlq.Len() != 0 {
		t.Fatalf("%d acks, stats %+v, %d dead letters; want %d acks, %d applied, %d duplicates",
			acks.Load(), s, f.dlq.Len(), workers*size, keys, workers*size-keys)
	}
	if s.InProgress == 0 {
		t.Log("no batch found a key in progress: the batches did not overlap this time")
	}
}

// claimsDown is a batch-capable store whose claims fail like an
// unreachable server.
type claimsDown struct{ *memstore.Store }

var errConnRefused = &dedup.StoreError{Store: "down", Op: "claim", Err: errors.New("connection refused"), NotApplied: true}

func (claimsDown) Claim(context.Context, dedup.Key, dedup.Fingerprint, time.Duration) (dedup.Claim, error) {
	return dedup.Claim{}, errConnRefused
}

func (claimsDown) ClaimBatch(context.Context, []dedup.ClaimRequest, time.Duration) ([]dedup.Claim, error) {
	return nil, errConnRefused
}

func TestProcessBatchStoreDownFailsClosed(t *testing.T) {
	mem, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	for name, store := range map[string]dedup.Store{
		"batch claim fails":             claimsDown{mem},
		"store without batch or extend": downStore{},
	} {
		t.Run(name, func(t *testing.T) {
			dlq := &consumer.MemoryDLQ{}
			var runs atomic.Int64
			p, err := consumer.New("orders", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
				runs.Add(1)
				return nil, nil
			}, consumer.WithDeadLetter(dlq), consumer.WithLimits(consumer.Limits{Unclassified: 1, Transient: 1}))
			if err != nil {
				t.Fatal(err)
			}
			batch := msgs("a", "b", "c", "a", "d")
			for i, m := range batch {
				m.Delivery = 10 + i
			}
			for i, d := range p.ProcessBatch(context.Background(), batch) {
				want(t, d, consumer.Retry)
				if !dedup.IsStoreError(d.Err) || d.Attempt != 0 {
					t.Fatalf("message %d: %+v, want a retry with the store error, not an attempt", i, d)
				}
			}
			if runs.Load() != 0 || dlq.Len() != 0 || p.Stats().StoreErrors != 5 || p.Stats().Retries != 5 {
				t.Fatalf("%d runs, %d dead letters, stats %+v; want no run, no dead letter, 5 store errors", runs.Load(), dlq.Len(), p.Stats())
			}
		})
	}
}

// TestProcessBatchKeepsWaitingClaimsAlive: five handlers of 20 s each
// under a 30 s lease make a 100 s batch. While each runs, another
// consumer tries to claim every other key of the batch: none may acquire
// one, neither a key waiting for its turn nor a success waiting for the
// batch's completion. The bubble's clock makes the 100 s instant.
func TestProcessBatchKeepsWaitingClaimsAlive(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New() // the system clock: the bubble's
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		ids := []string{"m1", "m2", "m3", "m4", "m5"}
		var stolen []string
		var fx effects
		p, err := consumer.New("orders", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
			time.Sleep(20 * time.Second)
			for _, id := range ids {
				if id == m.ID {
					continue
				}
				c, err := s.Claim(ctx, dedup.Key{Scope: "orders", ID: id}, "", time.Minute)
				if err != nil || c.Outcome == dedup.Acquired {
					stolen = append(stolen, fmt.Sprintf("%s while %s ran (%v)", id, m.ID, err))
				}
			}
			fx.add(m.ID)
			return nil, nil
		}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithLease(30*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for i, d := range p.ProcessBatch(context.Background(), msgs(ids...)) {
			if d.Action != consumer.Ack || d.Duplicate {
				t.Errorf("%s: %+v, want applied", ids[i], d)
			}
		}
		if took := time.Since(start); took < 100*time.Second {
			t.Fatalf("the batch took %v: the handlers did not wait", took)
		}
		if len(stolen) > 0 {
			t.Fatalf("claims of the batch expired while it ran: %v", stolen)
		}
		for _, id := range ids {
			c, _ := s.Claim(context.Background(), dedup.Key{Scope: "orders", ID: id}, "", time.Minute)
			if c.Outcome != dedup.Duplicate || fx.get(id) != 1 {
				t.Errorf("%s after the batch: %v, %d effects", id, c.Outcome, fx.get(id))
			}
		}
	})
}
