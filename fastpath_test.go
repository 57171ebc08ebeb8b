package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/storetest"
)

// ending is what one Do returned, what a later claim of its key finds,
// and (with hooks) the finish events it emitted.
type ending struct {
	res                  dedup.Result
	err                  error
	after                dedup.Outcome
	afterResult          string
	finishes             []string // "op" or "op: err"
	storeErrs, claimEvts int
}

// endScenario is one way a Do can go. setup makes the store Do runs on
// (a wrapper of mem, or mem) and may claim keys beforehand; h is the
// handler; ctx, when set, makes the context Do runs on.
type endScenario struct {
	name  string
	store func(mem *memstore.Store) dedup.Store
	opts  []dedup.RunnerOption
	setup func(t *testing.T, mem *memstore.Store, clock *storetest.Clock)
	h     func(mem *memstore.Store, clock *storetest.Clock, cancel context.CancelFunc) dedup.Handler
	want  func(t *testing.T, e ending)
}

// runEnding runs sc once, with a recording hook or none.
func runEnding(t *testing.T, sc endScenario, hooked bool) ending {
	t.Helper()
	mem, clock := newMem(t)
	var st dedup.Store = mem
	if sc.store != nil {
		st = sc.store(mem)
	}
	var (
		mu sync.Mutex
		e  ending
	)
	opts := append([]dedup.RunnerOption{dedup.WithClassifier(classify), dedup.WithLease(time.Minute)}, sc.opts...)
	if hooked {
		opts = append(opts, dedup.WithHooks(dedup.HookFunc(func(_ context.Context, ev any) {
			mu.Lock()
			defer mu.Unlock()
			switch ev := ev.(type) {
			case dedup.ClaimEvent:
				e.claimEvts++
			case dedup.FinishEvent:
				s := ev.Op
				if ev.Err != nil {
					s += ": " + ev.Err.Error()
				}
				e.finishes = append(e.finishes, s)
			case dedup.StoreErrorEvent:
				e.storeErrs++
			}
		})))
	}
	r := newRunner(t, st, opts...)
	if sc.setup != nil {
		sc.setup(t, mem, clock)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	e.res, e.err = r.Do(ctx, key, "fp", sc.h(mem, clock, cancel))
	c, err := mem.Claim(context.Background(), key, "fp", time.Minute)
	if err != nil {
		t.Fatalf("claim after Do: %v", err)
	}
	e.after, e.afterResult = c.Outcome, string(c.Result)
	return e
}

func succeed(out string) func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
	return func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
		return func(context.Context) ([]byte, error) { return []byte(out), nil }
	}
}

// TestRunnerEndsAlikeWithAndWithoutHooks pins how Do ends on every path
// the hookless success path (completed directly, without finalContext,
// disposal and finished) skips or shares: each scenario runs without
// hooks and with one, and must return the same Result and error and
// leave the store the same; with the hook, the finish events are pinned.
func TestRunnerEndsAlikeWithAndWithoutHooks(t *testing.T) {
	scenarios := []endScenario{
		{
			name: "success",
			h:    succeed("ok"),
			want: func(t *testing.T, e ending) {
				if e.err != nil || string(e.res.Result) != "ok" || e.res.Attempt != 1 || e.res.TakenOver || e.res.Duplicate || e.res.Recorded {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
				if e.after != dedup.Duplicate || e.afterResult != "ok" {
					t.Fatalf("after: %v %q, want the duplicate of ok", e.after, e.afterResult)
				}
			},
		},
		{
			name: "success on a take-over",
			setup: func(t *testing.T, mem *memstore.Store, clock *storetest.Clock) {
				if c, err := mem.Claim(context.Background(), key, "fp", time.Second); err != nil || c.Outcome != dedup.Acquired {
					t.Fatalf("first owner: %v %v", c.Outcome, err)
				}
				clock.Advance(2 * time.Second) // the first owner died
			},
			h: succeed("ok"),
			want: func(t *testing.T, e ending) {
				if e.err != nil || string(e.res.Result) != "ok" || e.res.Attempt != 2 || !e.res.TakenOver {
					t.Fatalf("Do = %+v, %v; want attempt 2, taken over", e.res, e.err)
				}
				if e.after != dedup.Duplicate {
					t.Fatalf("after: %v", e.after)
				}
			},
		},
		{
			name: "success, context cancelled in the handler",
			h: func(_ *memstore.Store, _ *storetest.Clock, cancel context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { cancel(); return []byte("charged"), nil }
			},
			want: func(t *testing.T, e ending) {
				if e.err != nil || string(e.res.Result) != "charged" {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
				if e.after != dedup.Duplicate || e.afterResult != "charged" {
					t.Fatalf("after: %v %q: the success was not recorded on the detached context", e.after, e.afterResult)
				}
			},
		},
		{
			name:  "success, complete refused twice (transient)",
			store: func(mem *memstore.Store) dedup.Store { return &refusing{Store: mem, refusals: 2} },
			h:     succeed("ok"),
			want: func(t *testing.T, e ending) {
				if e.err != nil || string(e.res.Result) != "ok" || e.after != dedup.Duplicate {
					t.Fatalf("Do = %+v, %v; after %v", e.res, e.err, e.after)
				}
			},
		},
		{
			name:  "success, context cancelled in the handler, complete refused once",
			store: func(mem *memstore.Store) dedup.Store { return &refusing{Store: mem, refusals: 1} },
			h: func(_ *memstore.Store, _ *storetest.Clock, cancel context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { cancel(); return []byte("ok"), nil }
			},
			want: func(t *testing.T, e ending) {
				if e.err != nil || e.after != dedup.Duplicate {
					t.Fatalf("Do = %+v, %v; after %v: the detached completion must be retried", e.res, e.err, e.after)
				}
			},
		},
		{
			name:  "success, complete fails (outcome unknown)",
			store: func(mem *memstore.Store) dedup.Store { return &failing{Store: mem, complete: true} },
			h:     succeed("ok"),
			want: func(t *testing.T, e ending) {
				if !dedup.IsStoreError(e.err) || string(e.res.Result) != "ok" || e.res.Duplicate {
					t.Fatalf("Do = %+v, %v; want the store error", e.res, e.err)
				}
				// Never released: the effect happened, the lease decides.
				if e.after != dedup.InProgress {
					t.Fatalf("after: %v, want the claim kept in progress", e.after)
				}
			},
		},
		{
			name: "success after the lease was lost",
			h: func(mem *memstore.Store, clock *storetest.Clock, _ context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) {
					clock.Advance(2 * time.Minute)
					if c, err := mem.Claim(context.Background(), key, "fp", time.Hour); err != nil || !c.TakenOver {
						return nil, fmt.Errorf("the take-over: %v %v", c.Outcome, err)
					}
					return []byte("late"), nil
				}
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, dedup.ErrLeaseLost) {
					t.Fatalf("Do = %+v, %v; want ErrLeaseLost", e.res, e.err)
				}
				if e.after != dedup.InProgress {
					t.Fatalf("after: %v, want the new owner's claim untouched", e.after)
				}
			},
		},
		{
			name: "failure released",
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return []byte("partial"), errors.New("transient") }
			},
			want: func(t *testing.T, e ending) {
				if e.err == nil || e.err.Error() != "transient" || e.res.Result != nil || e.res.Attempt != 1 {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
				if e.after != dedup.Acquired {
					t.Fatalf("after: %v, want released", e.after)
				}
			},
		},
		{
			name: "failure released, context cancelled in the handler",
			h: func(_ *memstore.Store, _ *storetest.Clock, cancel context.CancelFunc) dedup.Handler {
				return func(ctx context.Context) ([]byte, error) { cancel(); return nil, ctx.Err() }
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, context.Canceled) || e.after != dedup.Acquired {
					t.Fatalf("Do = %+v, %v; after %v, want released on the detached context", e.res, e.err, e.after)
				}
			},
		},
		{
			name: "unknown outcome kept",
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return nil, errUnknown }
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, errUnknown) || e.after != dedup.InProgress {
					t.Fatalf("Do = %+v, %v; after %v, want kept", e.res, e.err, e.after)
				}
			},
		},
		{
			name: "unknown outcome kept, context cancelled in the handler",
			h: func(_ *memstore.Store, _ *storetest.Clock, cancel context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { cancel(); return nil, errUnknown }
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, errUnknown) || e.after != dedup.InProgress {
					t.Fatalf("Do = %+v, %v; after %v: an unknown outcome was released", e.res, e.err, e.after)
				}
			},
		},
		{
			name: "rejection recorded",
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return nil, rejected{"declined"} }
			},
			want: func(t *testing.T, e ending) {
				const r = `{"status":"rejected","reason":"declined"}`
				if !errors.As(e.err, new(rejected)) || !e.res.Recorded || string(e.res.Result) != r {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
				if e.after != dedup.Duplicate || e.afterResult != r {
					t.Fatalf("after: %v %q", e.after, e.afterResult)
				}
			},
		},
		{
			name: "duplicate",
			setup: func(t *testing.T, mem *memstore.Store, _ *storetest.Clock) {
				c, _ := mem.Claim(context.Background(), key, "fp", time.Minute)
				if err := mem.Complete(context.Background(), c, []byte("first"), time.Hour); err != nil {
					t.Fatal(err)
				}
			},
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return nil, errors.New("ran on a duplicate") }
			},
			want: func(t *testing.T, e ending) {
				if e.err != nil || !e.res.Duplicate || string(e.res.Result) != "first" || e.res.Attempt != 1 {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
			},
		},
		{
			name: "in progress",
			setup: func(t *testing.T, mem *memstore.Store, _ *storetest.Clock) {
				mem.Claim(context.Background(), key, "fp", time.Minute)
			},
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return nil, errors.New("ran on a key in progress") }
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, dedup.ErrInProgress) || e.res.Attempt != 1 || e.after != dedup.InProgress {
					t.Fatalf("Do = %+v, %v; after %v", e.res, e.err, e.after)
				}
			},
		},
		{
			name: "fingerprint mismatch",
			setup: func(t *testing.T, mem *memstore.Store, _ *storetest.Clock) {
				c, _ := mem.Claim(context.Background(), key, "other", time.Minute)
				mem.Complete(context.Background(), c, nil, time.Hour)
			},
			h: func(*memstore.Store, *storetest.Clock, context.CancelFunc) dedup.Handler {
				return func(context.Context) ([]byte, error) { return nil, errors.New("ran on a mismatch") }
			},
			want: func(t *testing.T, e ending) {
				if !errors.Is(e.err, dedup.ErrFingerprintMismatch) || e.res.Duplicate {
					t.Fatalf("Do = %+v, %v", e.res, e.err)
				}
			},
		},
		{
			name: "success with a heartbeat",
			opts: []dedup.RunnerOption{dedup.WithHeartbeat(time.Millisecond)},
			h:    succeed("ok"),
			want: func(t *testing.T, e ending) {
				if e.err != nil || string(e.res.Result) != "ok" || e.after != dedup.Duplicate {
					t.Fatalf("Do = %+v, %v; after %v", e.res, e.err, e.after)
				}
			},
		},
	}
	wantFinishes := map[string][]string{
		"success":                {"complete"},
		"success on a take-over": {"complete"},
		"success, context cancelled in the handler":                        {"complete"},
		"success, complete refused twice (transient)":                      {"complete"},
		"success, context cancelled in the handler, complete refused once": {"complete"},
		"success, complete fails (outcome unknown)":                        {"complete: " + errDown.Error()},
		"success after the lease was lost":                                 {"complete: " + dedup.ErrLeaseLost.Error()},
		"failure released":                                                 {"release"},
		"failure released, context cancelled in the handler":               {"release"},
		"unknown outcome kept":                                             {"keep"},
		"unknown outcome kept, context cancelled in the handler":           {"keep"},
		"rejection recorded":                                               {"complete"},
		"duplicate":                                                        nil,
		"in progress":                                                      nil,
		"fingerprint mismatch":                                             nil,
		"success with a heartbeat":                                         {"complete"},
	}
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			bare, hooked := runEnding(t, sc, false), runEnding(t, sc, true)
			t.Run("without hooks", func(t *testing.T) { sc.want(t, bare) })
			t.Run("with hooks", func(t *testing.T) { sc.want(t, hooked) })
			if fmt.Sprintf("%+v", bare.res) != fmt.Sprintf("%+v", hooked.res) || fmt.Sprint(bare.err) != fmt.Sprint(hooked.err) ||
				bare.after != hooked.after || bare.afterResult != hooked.afterResult {
				t.Fatalf("Do ends differently with hooks:\n without: %+v %v, after %v %q\n    with: %+v %v, after %v %q",
					bare.res, bare.err, bare.after, bare.afterResult, hooked.res, hooked.err, hooked.after, hooked.afterResult)
			}
			want, ok := wantFinishes[sc.name]
			if !ok {
				t.Fatalf("no finish events pinned for %q", sc.name)
			}
			if fmt.Sprint(hooked.finishes) != fmt.Sprint(want) || hooked.claimEvts != 1 {
				t.Fatalf("with hooks: finish events %q after %d claim events, want %q after 1", hooked.finishes, hooked.claimEvts, want)
			}
			storeErrs := 0
			if sc.name == "success, complete fails (outcome unknown)" {
				storeErrs = 1
			}
			if hooked.storeErrs != storeErrs {
				t.Fatalf("with hooks: %d store error events, want %d", hooked.storeErrs, storeErrs)
			}
		})
	}
}

// TestRunnerResultsAreTheirOwn: a Result is not overwritten by a later
// Do, on the same runner or concurrently, and a duplicate's stored result
// is a copy: changing it changes neither the record nor the next
// duplicate's.
func TestRunnerResultsAreTheirOwn(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	ctx := context.Background()
	buf := []byte("first")
	first, err := r.Do(ctx, k("a"), "", func(context.Context) ([]byte, error) { return buf[:5], nil })
	if err != nil {
		t.Fatal(err)
	}
	second, err := r.Do(ctx, k("b"), "", func(context.Context) ([]byte, error) { return []byte("second"), nil })
	if err != nil || string(first.Result) != "first" || string(second.Result) != "second" {
		t.Fatalf("results %q and %q (%v)", first.Result, second.Result, err)
	}
	// The handler's buffer reused after Do: the stored result is the store's.
	copy(buf, "XXXXX")
	dup, err := r.Do(ctx, k("a"), "", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
	if err != nil || !dup.Duplicate || string(dup.Result) != "first" {
		t.Fatalf("duplicate of a: %+v %v, want the stored copy of first", dup, err)
	}
	copy(dup.Result, "YYYYY")
	dup2, err := r.Do(ctx, k("a"), "", func(context.Context) ([]byte, error) { return nil, errors.New("ran again") })
	if err != nil || string(dup2.Result) != "first" {
		t.Fatalf("a duplicate's result changed by the caller reached the record: %q %v", dup2.Result, err)
	}

	// Concurrent Dos on one runner: each gets its own key's result.
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for i := range 64 {
		wg.Go(func() {
			id := fmt.Sprint("c", i%16)
			res, err := r.Do(ctx, k(id), "", func(context.Context) ([]byte, error) { return []byte(id), nil })
			switch {
			case errors.Is(err, dedup.ErrInProgress):
			case err != nil:
				errs <- err
			case string(res.Result) != id:
				errs <- fmt.Errorf("key %s: result %q", id, res.Result)
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}
