package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
)

// pathStep is one delivery of a scripted run: advance the clock, then
// process m (the handlers of cancel-ok and cancel-fail cancel the
// delivery's context).
type pathStep struct {
	id      string
	payload string
	advance time.Duration
	deliver int
	hold    bool // claim the key in the store first (another consumer has it)
}

// pathRun is what a scripted run decided and what its handler saw.
type pathRun struct {
	decisions []string
	seen      []string // the Delivery of each handler call
	stats     consumer.Stats
	dlq       int
	asked     int64 // reconciler calls
	events    []string
}

// runPath processes steps on a fresh processor in store mode with or
// without a reconciler (that says "not applied") and runner hooks.
func runPath(t *testing.T, steps []pathStep, reconciler, hooked bool) pathRun {
	t.Helper()
	f := newFixture(t)
	var (
		run  pathRun
		mu   sync.Mutex
		runs = map[string]int{}
	)
	opts := []consumer.Option{consumer.WithPayloadFingerprint(), consumer.WithLease(10 * time.Second), consumer.WithMaxDeliveries(5)}
	var asked atomic.Int64
	if reconciler {
		opts = append(opts, consumer.WithReconciler(func(context.Context, dedup.Key, *consumer.Message) (consumer.Reconciled, error) {
			asked.Add(1)
			return consumer.Reconciled{}, nil
		}))
	}
	if hooked {
		opts = append(opts, consumer.WithRunnerOptions(dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
			mu.Lock()
			defer mu.Unlock()
			switch e := e.(type) {
			case dedup.ClaimEvent:
				run.events = append(run.events, fmt.Sprintf("claim %s %v", e.Key.ID, e.Outcome))
			case dedup.FinishEvent:
				run.events = append(run.events, fmt.Sprintf("finish %s %s %v", e.Key.ID, e.Op, e.Err))
			}
		}))))
	}
	var cancel context.CancelFunc
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		runs[m.ID]++
		run.seen = append(run.seen, fmt.Sprintf("%s attempt=%d takenOver=%v", m.ID, d.Attempt, d.TakenOver))
		switch m.ID {
		case "flaky":
			if runs[m.ID] == 1 {
				return nil, consumer.Transient(errors.New("flaky"))
			}
		case "perm":
			return nil, consumer.Permanent(errors.New("perm"))
		case "plain":
			return nil, errors.New("plain")
		case "panic":
			panic("bug")
		case "reject":
			return nil, consumer.Reject(errors.New("declined"), []byte("declined"))
		case "unknown":
			if runs[m.ID] == 1 {
				return nil, consumer.Unknown(errors.New("timeout"))
			}
		case "cancel-ok":
			cancel()
			return []byte("done before the cancel"), nil
		case "cancel-fail":
			cancel()
			return nil, ctx.Err()
		}
		return []byte("r-" + m.ID), nil
	}, opts...)
	for _, s := range steps {
		f.clock.Advance(s.advance)
		m := msg(s.id)
		if s.payload != "" {
			m.Payload = []byte(s.payload)
		}
		m.Delivery = max(s.deliver, 1)
		if s.hold {
			key := dedup.Key{Scope: "orders", ID: s.id}
			if c, err := f.store.Claim(context.Background(), key, dedup.FingerprintOf(m.Payload), time.Minute); err != nil || c.Outcome != dedup.Acquired {
				t.Fatalf("hold %s: %v %v", s.id, c.Outcome, err)
			}
		}
		var ctx context.Context
		ctx, cancel = context.WithCancel(context.Background())
		d := p.Process(ctx, m)
		cancel()
		run.decisions = append(run.decisions, fmt.Sprintf("%s: %v dup=%v result=%q class=%v attempt=%d key=%v err=%v",
			s.id, d.Action, d.Duplicate, d.Result, d.Class, d.Attempt, d.Key, d.Err))
	}
	run.stats, run.dlq, run.asked = p.Stats(), f.dlq.Len(), asked.Load()
	return run
}

// pathSteps goes through every way Process ends in store mode but the
// unknown outcome (which a reconciler settles differently).
var pathSteps = []pathStep{
	{id: "ok"},
	{id: "ok"}, // duplicate
	{id: "flaky"},
	{id: "flaky"},
	{id: "perm"}, {id: "perm"}, {id: "perm"},
	{id: "plain"},
	{id: "panic"},
	{id: "panic"},
	{id: "reject"},
	{id: "reject"}, // duplicate of the rejection
	{id: "cancel-ok"},
	{id: "cancel-ok"}, // recorded: a duplicate
	{id: "cancel-fail"},
	{id: "cancel-fail"}, // released: runs again
	{id: "ok", payload: "other bytes"},
	{id: "held", hold: true},
	{id: "over", deliver: 6},
	{id: ""},
}

// TestProcessEndsAlikeOnEveryRunnerPath pins Process's decisions, the
// Delivery its handler sees and its stats on every path, and checks that
// they are the same whether the handler is called directly (no
// reconciler) and the runner completes directly (no hooks) or not.
func TestProcessEndsAlikeOnEveryRunnerPath(t *testing.T) {
	base := runPath(t, pathSteps, false, false)
	wantActions := []consumer.Action{
		consumer.Ack, consumer.Ack,
		consumer.Retry, consumer.Ack,
		consumer.Retry, consumer.Retry, consumer.DeadLettered,
		consumer.Retry,
		consumer.Retry, consumer.Retry,
		consumer.Rejected, consumer.Ack,
		consumer.Ack, consumer.Ack,
		consumer.Retry, consumer.Retry,
		consumer.DeadLettered,
		consumer.Retry,
		consumer.DeadLettered,
		consumer.DeadLettered,
	}
	if len(base.decisions) != len(wantActions) {
		t.Fatalf("%d decisions", len(base.decisions))
	}
	for i, a := range wantActions {
		if !hasPrefixAction(base.decisions[i], pathSteps[i].id, a) {
			t.Errorf("step %d: %s, want %v", i, base.decisions[i], a)
		}
	}
	wantSeen := []string{
		"ok attempt=1 takenOver=false",
		"flaky attempt=1 takenOver=false", "flaky attempt=2 takenOver=false",
		"perm attempt=1 takenOver=false", "perm attempt=2 takenOver=false", "perm attempt=3 takenOver=false",
		"plain attempt=1 takenOver=false",
		"panic attempt=1 takenOver=false", "panic attempt=2 takenOver=false",
		"reject attempt=1 takenOver=false",
		"cancel-ok attempt=1 takenOver=false",
		"cancel-fail attempt=1 takenOver=false", "cancel-fail attempt=1 takenOver=false",
	}
	if !slices.Equal(base.seen, wantSeen) {
		t.Errorf("the handler saw\n %q\nwant\n %q", base.seen, wantSeen)
	}
	wantStats := consumer.Stats{Applied: 3, Duplicates: 3, Retries: 9, DeadLettered: 4, Rejected: 1, InProgress: 1}
	if base.stats != wantStats || base.dlq != 4 {
		t.Errorf("stats %+v, dlq %d; want %+v, 4", base.stats, base.dlq, wantStats)
	}
	wantEvents := []string{
		"claim ok acquired", "finish ok complete <nil>", "claim ok duplicate",
		"claim flaky acquired", "finish flaky release <nil>", "claim flaky acquired", "finish flaky complete <nil>",
		"claim perm acquired", "finish perm release <nil>", "claim perm acquired", "finish perm release <nil>",
		"claim perm acquired", "finish perm release <nil>",
		"claim plain acquired", "finish plain release <nil>",
		"claim panic acquired", "finish panic release <nil>", "claim panic acquired", "finish panic release <nil>",
		"claim reject acquired", "finish reject complete <nil>", "claim reject duplicate",
		"claim cancel-ok acquired", "finish cancel-ok complete <nil>", "claim cancel-ok duplicate",
		"claim cancel-fail acquired", "finish cancel-fail release <nil>", "claim cancel-fail acquired", "finish cancel-fail release <nil>",
		"claim ok fingerprint_mismatch", "claim held in_progress",
	}
	for _, cfg := range []struct {
		name               string
		reconciler, hooked bool
	}{{"hooks", false, true}, {"reconciler", true, false}, {"reconciler and hooks", true, true}} {
		t.Run(cfg.name, func(t *testing.T) {
			got := runPath(t, pathSteps, cfg.reconciler, cfg.hooked)
			if !slices.Equal(got.decisions, base.decisions) {
				t.Errorf("decisions\n %q\nwant (no reconciler, no hooks)\n %q", got.decisions, base.decisions)
			}
			if !slices.Equal(got.seen, base.seen) || got.stats != base.stats || got.dlq != base.dlq {
				t.Errorf("seen %q stats %+v dlq %d; want %q %+v %d", got.seen, got.stats, got.dlq, base.seen, base.stats, base.dlq)
			}
			if got.asked != 0 {
				t.Errorf("the reconciler was asked %d times on paths without an unknown outcome", got.asked)
			}
			if cfg.hooked {
				// A claim event per message claimed, a finish per claim acquired.
				if !slices.Equal(got.events, wantEvents) {
					t.Errorf("runner events\n %q\nwant\n %q", got.events, wantEvents)
				}
			}
		})
	}
}

func hasPrefixAction(decision, id string, a consumer.Action) bool {
	return strings.HasPrefix(decision, id+": "+a.String()+" ")
}

// TestProcessUnknownOutcomeEndsAlikeWithHooks: an unknown outcome keeps
// the claim for its lease (the delivery inside it is in progress), and the
// take-over tells the handler, with runner hooks or without.
func TestProcessUnknownOutcomeEndsAlikeWithHooks(t *testing.T) {
	steps := []pathStep{{id: "unknown"}, {id: "unknown"}, {id: "unknown", advance: 11 * time.Second}, {id: "unknown"}}
	base := runPath(t, steps, false, false)
	wantActions := []consumer.Action{consumer.Retry, consumer.Retry, consumer.Ack, consumer.Ack}
	for i, a := range wantActions {
		if !hasPrefixAction(base.decisions[i], "unknown", a) {
			t.Errorf("step %d: %s, want %v", i, base.decisions[i], a)
		}
	}
	wantSeen := []string{"unknown attempt=1 takenOver=false", "unknown attempt=2 takenOver=true"}
	if !slices.Equal(base.seen, wantSeen) || base.stats.InProgress != 1 || base.stats.Duplicates != 1 {
		t.Errorf("seen %q stats %+v; want %q, one in progress, one duplicate", base.seen, base.stats, wantSeen)
	}
	got := runPath(t, steps, false, true)
	if !slices.Equal(got.decisions, base.decisions) || !slices.Equal(got.seen, base.seen) || got.stats != base.stats {
		t.Errorf("with hooks:\n %q %q %+v\nwithout:\n %q %q %+v", got.decisions, got.seen, got.stats, base.decisions, base.seen, base.stats)
	}
}

// TestDecisionResultsAreTheirOwn: a decision's Result is not overwritten
// by a later Process, sequential or concurrent, and changing a
// duplicate's Result does not reach the store.
func TestDecisionResultsAreTheirOwn(t *testing.T) {
	f := newFixture(t)
	p := f.processor(t, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return []byte("result of " + m.ID), nil
	})
	ctx := context.Background()
	a := p.Process(ctx, msg("a"))
	b := p.Process(ctx, msg("b"))
	if string(a.Result) != "result of a" || string(b.Result) != "result of b" {
		t.Fatalf("results %q, %q", a.Result, b.Result)
	}
	dup := p.Process(ctx, msg("a"))
	if !dup.Duplicate || string(dup.Result) != "result of a" {
		t.Fatalf("duplicate %+v", dup)
	}
	copy(dup.Result, "XXXXXX")
	if again := p.Process(ctx, msg("a")); string(again.Result) != "result of a" || string(a.Result) != "result of a" {
		t.Fatalf("a duplicate's result changed by the caller reached the store or the first decision: %q, %q", again.Result, a.Result)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 128)
	for i := range 128 {
		wg.Go(func() {
			id := fmt.Sprint("c", i%32)
			d := p.Process(ctx, msg(id))
			if d.Action == consumer.Ack && string(d.Result) != "result of "+id {
				errs <- fmt.Sprintf("%s: %+v", id, d)
			}
		})
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
}
