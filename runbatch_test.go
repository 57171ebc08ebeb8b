package dedup_test

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
	"github.com/dedupkit/dedup/memstore"
)

func k(id string) dedup.Key { return dedup.Key{Scope: "test", ID: id} }

// byID is a batch handler that behaves by key ID and counts its runs.
type byID struct {
	mu   sync.Mutex
	runs map[string]int
}

func (b *byID) handler(reqs []dedup.ClaimRequest) dedup.BatchHandler {
	return func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
		id := reqs[i].Key.ID
		if c.Key != reqs[i].Key {
			return nil, fmt.Errorf("request %d (%s) ran under the claim of %s", i, id, c.Key.ID)
		}
		b.mu.Lock()
		if b.runs == nil {
			b.runs = map[string]int{}
		}
		b.runs[id]++
		b.mu.Unlock()
		switch id {
		case "fails":
			return nil, errors.New("transient")
		case "unknown":
			return nil, errUnknown
		case "rejected":
			return nil, rejected{"card declined"}
		}
		if strings.HasPrefix(id, "boom") {
			panic("bug")
		}
		return []byte("ok:" + id), nil
	}
}

func (b *byID) count(id string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.runs[id]
}

// TestDoBatchAsDo: DoBatch returns for each request what DoClaim returns
// for the requests one after the other, and leaves the store in the same
// state.
func TestDoBatchAsDo(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T) (*memstore.Store, *dedup.Runner) {
		s, _ := newMem(t)
		r := newRunner(t, s, dedup.WithClassifier(classify))
		c, _ := s.Claim(ctx, k("dup"), "a", time.Minute)
		s.Complete(ctx, c, []byte("stored"), time.Hour)
		c, _ = s.Claim(ctx, k("mismatch"), "a", time.Minute)
		s.Complete(ctx, c, nil, time.Hour)
		s.Claim(ctx, k("held"), "", time.Minute)
		return s, r
	}
	reqs := []dedup.ClaimRequest{
		{Key: k("new")}, {Key: k("dup"), Fingerprint: "a"}, {Key: k("held")}, {Key: k("mismatch"), Fingerprint: "b"},
		{Key: dedup.Key{Scope: "test", ID: "bad\x00id"}}, {Key: k("fails")}, {Key: k("unknown")}, {Key: k("rejected")},
		{Key: k("new2"), Fingerprint: dedup.Fingerprint(strings.Repeat("f", dedup.MaxFingerprintBytes+1))},
		{Key: k("last")},
	}
	s1, r1 := setup(t)
	var h1 byID
	want := make([]dedup.Result, len(reqs))
	wantErrs := make([]error, len(reqs))
	for i, q := range reqs {
		want[i], wantErrs[i] = r1.DoClaim(ctx, q.Key, q.Fingerprint, func(ctx context.Context, c dedup.Claim) ([]byte, error) {
			return h1.handler(reqs)(ctx, i, c)
		})
	}
	s2, r2 := setup(t)
	var h2 byID
	got, errs := r2.DoBatch(ctx, reqs, h2.handler(reqs))
	for i := range reqs {
		g, w := fmt.Sprintf("%+v %v", got[i], errs[i]), fmt.Sprintf("%+v %v", want[i], wantErrs[i])
		if g != w {
			t.Errorf("request %d (%s): DoBatch %s, DoClaim %s", i, reqs[i].Key.ID, g, w)
		}
	}
	for _, q := range reqs {
		if h1.count(q.Key.ID) != h2.count(q.Key.ID) {
			t.Errorf("%s ran %d times in DoClaim, %d in DoBatch", q.Key.ID, h1.count(q.Key.ID), h2.count(q.Key.ID))
		}
		a, _ := s1.Claim(ctx, q.Key, q.Fingerprint, time.Second)
		b, _ := s2.Claim(ctx, q.Key, q.Fingerprint, time.Second)
		if a.Outcome != b.Outcome || string(a.Result) != string(b.Result) {
			t.Errorf("%s afterwards: %v %q after DoClaim, %v %q after DoBatch", q.Key.ID, a.Outcome, a.Result, b.Outcome, b.Result)
		}
	}
	if !errors.Is(errs[4], dedup.ErrInvalidArgument) || !errors.Is(errs[8], dedup.ErrInvalidArgument) || got[0].Result == nil {
		t.Fatalf("results %+v, errors %v", got, errs)
	}
}

func TestDoBatchRepeatedKeyIsInProgress(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("a")}}
	var h byID
	got, errs := r.DoBatch(context.Background(), reqs, h.handler(reqs))
	if errs[0] != nil || got[0].Duplicate || !errors.Is(errs[1], dedup.ErrInProgress) || h.count("a") != 1 {
		t.Fatalf("DoBatch of one key twice: %+v %v; want the first applied, the second in progress", got, errs)
	}
	res, err := r.Do(context.Background(), k("a"), "", func(context.Context) ([]byte, error) { return nil, nil })
	if err != nil || !res.Duplicate {
		t.Fatalf("the repeated request done again: %+v %v, want a duplicate", res, err)
	}
}

// TestDoBatchHooks: the batch emits the events of Do, one claim and one
// finish per request.
func TestDoBatchHooks(t *testing.T) {
	s, _ := newMem(t)
	var n counter
	r := newRunner(t, s, dedup.WithHooks(&n), dedup.WithClassifier(classify))
	c, _ := s.Claim(context.Background(), k("dup"), "", time.Minute)
	s.Complete(context.Background(), c, nil, time.Hour)
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("dup")}, {Key: k("fails")}, {Key: k("unknown")}, {Key: k("b")}}
	var h byID
	r.DoBatch(context.Background(), reqs, h.handler(reqs))
	got := [5]int32{n.claims.Load(), n.dups.Load(), n.takeovers.Load(), n.finishes.Load(), n.storeErrs.Load()}
	if want := [5]int32{5, 1, 0, 4, 0}; got != want {
		t.Fatalf("hook counts (claims, duplicates, take-overs, finishes, store errors) = %v, want %v", got, want)
	}
}

// batchDown is a store whose batch claim fails.
type batchDown struct{ *memstore.Store }

func (batchDown) ClaimBatch(context.Context, []dedup.ClaimRequest, time.Duration) ([]dedup.Claim, error) {
	return nil, errDown
}

func TestDoBatchFailsClosed(t *testing.T) {
	s, _ := newMem(t)
	var n counter
	r := newRunner(t, batchDown{s}, dedup.WithHooks(&n))
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: dedup.Key{}}}
	var h byID
	got, errs := r.DoBatch(context.Background(), reqs, h.handler(reqs))
	for i := range 2 {
		if !dedup.IsStoreError(errs[i]) || got[i].Duplicate {
			t.Fatalf("request %d on a failed batch claim: %+v %v, want the store error", i, got[i], errs[i])
		}
	}
	if !errors.Is(errs[2], dedup.ErrInvalidArgument) || h.count("a")+h.count("b") != 0 || n.storeErrs.Load() != 3 {
		t.Fatalf("errors %v, runs %v, store error events %d", errs, h.runs, n.storeErrs.Load())
	}
}

// TestDoBatchPanic: a panic releases its claim and every claim not yet
// run; it is returned, the success before it is completed, and the
// requests after it are done alone (a panic there is returned too).
func TestDoBatchPanic(t *testing.T) {
	s, _ := newMem(t)
	var ops []string
	r := newRunner(t, s, dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
		if f, ok := e.(dedup.FinishEvent); ok {
			ops = append(ops, f.Op+" "+f.Key.ID)
		}
	})))
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("boom")}, {Key: k("b")}, {Key: k("boom2")}, {Key: k("c")}}
	var h byID
	got, errs := r.DoBatch(context.Background(), reqs, h.handler(reqs))
	var pe *dedup.PanicError
	if !errors.As(errs[1], &pe) || pe.Value != "bug" || !errors.As(errs[3], &pe) {
		t.Fatalf("errors %v, want the panics as *PanicError", errs)
	}
	for _, i := range []int{0, 2, 4} {
		if errs[i] != nil || got[i].Duplicate || h.count(reqs[i].Key.ID) != 1 {
			t.Fatalf("request %d: %+v %v, %d runs", i, got[i], errs[i], h.count(reqs[i].Key.ID))
		}
	}
	want := "release boom, release b, release boom2, release c, complete a, complete b, release boom2, complete c"
	if strings.Join(ops, ", ") != want {
		t.Fatalf("finishes %v, want %s", ops, want)
	}
	if c, _ := s.Claim(context.Background(), k("boom"), "", time.Second); c.Outcome != dedup.Acquired {
		t.Fatalf("the key that panicked is %v, want released", c.Outcome)
	}
}

// TestDoBatchCancelled: once the context is done, the claims not yet run
// are released and their requests fail closed as a claim on a done
// context does; the success before is still completed.
func TestDoBatchCancelled(t *testing.T) {
	s, _ := newMem(t)
	r := newRunner(t, s)
	ctx, cancel := context.WithCancel(context.Background())
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}
	got, errs := r.DoBatch(ctx, reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
		cancel() // shutdown begins while a is applied
		return []byte("a"), nil
	})
	if errs[0] != nil || string(got[0].Result) != "a" {
		t.Fatalf("the request that ran: %+v %v", got[0], errs[0])
	}
	for _, id := range []string{"b", "c"} {
		i := int(id[0] - 'a')
		if !dedup.IsStoreError(errs[i]) || !errors.Is(errs[i], context.Canceled) {
			t.Fatalf("%s after the cancel: %v, want a store error wrapping context.Canceled", id, errs[i])
		}
		if c, _ := s.Claim(context.Background(), k(id), "", time.Second); c.Outcome != dedup.Acquired {
			t.Fatalf("%s after the cancel is %v, want released", id, c.Outcome)
		}
	}
	if c, _ := s.Claim(context.Background(), k("a"), "", time.Second); c.Outcome != dedup.Duplicate {
		t.Fatalf("a after the cancel is %v, want completed", c.Outcome)
	}
}

// noExtend hides the store's Extend and batch abilities.
type noExtend struct{ dedup.Store }

func TestDoBatchWithoutExtenderRunsEachAlone(t *testing.T) {
	s, _ := newMem(t)
	var claims int
	r := newRunner(t, noExtend{s}, dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
		if _, ok := e.(dedup.ClaimEvent); ok {
			claims++
		}
	})))
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("a")}}
	var h byID
	got, errs := r.DoBatch(context.Background(), reqs, h.handler(reqs))
	if errs[0] != nil || errs[1] != nil || errs[2] != nil || !got[2].Duplicate || claims != 3 {
		t.Fatalf("results %+v %v, %d claims: want each request done as Do, in order", got, errs, claims)
	}
}

// extendHook lets a test decide what Extend does.
type extendHook struct {
	*memstore.Store
	extend func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error)
}

func (e extendHook) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	return e.extend(ctx, c, lease)
}

// TestDoBatchLostClaimIsNotRunOn: a waiting claim the heartbeat finds
// lost (another owner took the key) is not run on: its request is done
// alone, and finds the key in progress.
func TestDoBatchLostClaimIsNotRunOn(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		store := extendHook{Store: s}
		store.extend = func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
			if c.Key.ID == "b" { // another consumer takes b over
				s.Release(ctx, c)
				s.Claim(ctx, c.Key, "", time.Hour)
				return c, dedup.ErrLeaseLost
			}
			return s.Extend(ctx, c, lease)
		}
		r := newRunner(t, store, dedup.WithLease(30*time.Second))
		reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}
		var h byID
		run := h.handler(reqs)
		got, errs := r.DoBatch(context.Background(), reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
			time.Sleep(15 * time.Second) // a heartbeat passes
			return run(ctx, i, c)
		})
		if errs[0] != nil || errs[2] != nil || !errors.Is(errs[1], dedup.ErrInProgress) || h.count("b") != 0 {
			t.Fatalf("results %+v %v, runs %v; want b not run (in progress elsewhere)", got, errs, h.runs)
		}
	})
}

// TestDoBatchUnextendedClaimIsDoneAlone: when extensions fail (the store
// is flaky) a claim that went half a lease without one is released and
// its request done alone, with a fresh lease.
func TestDoBatchUnextendedClaimIsDoneAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		store := extendHook{Store: s, extend: func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
			return c, &dedup.StoreError{Store: "flaky", Op: "extend", Err: errors.New("timeout")}
		}}
		var claims []string
		r := newRunner(t, store, dedup.WithLease(30*time.Second), dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
			if c, ok := e.(dedup.ClaimEvent); ok {
				claims = append(claims, c.Key.ID)
			}
		})))
		reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}
		var h byID
		run := h.handler(reqs)
		got, errs := r.DoBatch(context.Background(), reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
			if time.Until(c.LeaseUntil) < 29*time.Second {
				return nil, fmt.Errorf("%s started with %v of its lease", reqs[i].Key.ID, time.Until(c.LeaseUntil))
			}
			time.Sleep(20 * time.Second)
			return run(ctx, i, c)
		})
		for i := range reqs {
			if errs[i] != nil || got[i].Duplicate || h.count(reqs[i].Key.ID) != 1 {
				t.Fatalf("request %d: %+v %v", i, got[i], errs[i])
			}
		}
		if want := "a, b, c, b, c"; strings.Join(claims, ", ") != want {
			t.Fatalf("claims %v, want %s (b and c claimed again alone)", claims, want)
		}
	})
}

// TestCompleteBatchFallback: on a store without BatchCompleter the helper
// completes item by item with the same per-item results, and checks every
// item before it writes any.
func TestCompleteBatchFallback(t *testing.T) {
	s, clock := newMem(t)
	plain := noExtend{s}
	ctx := context.Background()
	a, _ := s.Claim(ctx, k("a"), "", time.Minute)
	stale, _ := s.Claim(ctx, k("b"), "", time.Second)
	clock.Advance(2 * time.Second)
	s.Claim(ctx, k("b"), "", time.Minute) // taken over
	items := []dedup.Completion{{Claim: a, Result: []byte("ra")}, {Claim: stale}}
	if _, err := dedup.CompleteBatch(ctx, plain, append(items, dedup.Completion{Claim: dedup.Claim{Key: k("x")}}), time.Hour); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("an item not acquired: %v, want ErrInvalidArgument", err)
	}
	if c, _ := s.Claim(ctx, k("a"), "", time.Minute); c.Outcome != dedup.InProgress {
		t.Fatalf("a rejected batch wrote a: %v", c.Outcome)
	}
	errs, err := dedup.CompleteBatch(ctx, plain, items, time.Hour)
	if err != nil || len(errs) != 2 || errs[0] != nil || !errors.Is(errs[1], dedup.ErrLeaseLost) {
		t.Fatalf("CompleteBatch = %v, %v; want [nil ErrLeaseLost]", errs, err)
	}
	if c, _ := s.Claim(ctx, k("a"), "", time.Minute); c.Outcome != dedup.Duplicate || string(c.Result) != "ra" {
		t.Fatalf("a after the batch: %v %q", c.Outcome, c.Result)
	}
}

// claimFailsOn fails the claim of one key.
type claimFailsOn struct {
	dedup.Store
	id string
}

func (f claimFailsOn) Claim(ctx context.Context, key dedup.Key, fp dedup.Fingerprint, l time.Duration) (dedup.Claim, error) {
	if key.ID == f.id {
		return dedup.Claim{}, errDown
	}
	return f.Store.Claim(ctx, key, fp, l)
}

// TestClaimBatchFallbackReleasesOnError: the one-by-one fallback hands
// back the keys it acquired when a later claim fails.
func TestClaimBatchFallbackReleasesOnError(t *testing.T) {
	s, _ := newMem(t)
	ctx := context.Background()
	_, err := dedup.ClaimBatch(ctx, claimFailsOn{s, "c"}, []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}, time.Minute)
	if !dedup.IsStoreError(err) {
		t.Fatalf("ClaimBatch = %v, want the store error", err)
	}
	for _, id := range []string{"a", "b"} {
		if c, _ := s.Claim(ctx, k(id), "", time.Minute); c.Outcome != dedup.Acquired {
			t.Fatalf("%s after the failed batch is %v, want released", id, c.Outcome)
		}
	}
}

// cancelDuring is a memstore whose CompleteBatch calls cancel and then
// honours its context, as a store on the network does when the context
// ends during the round trip.
type cancelDuring struct {
	*memstore.Store
	cancel context.CancelFunc
}

func (s cancelDuring) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	s.cancel()
	if err := ctx.Err(); err != nil {
		return nil, &dedup.StoreError{Store: "cancel-during", Op: "complete batch", Err: err}
	}
	return s.Store.CompleteBatch(ctx, items, ret)
}

// TestFinishCompletesThoughCancelledDuring: a batch whose handlers
// succeeded is completed even when its context ends while the completion
// is in flight (a shutdown while a pipeline completes the batch on its
// own goroutine, which the next batch's work or a Close cancels): the
// completion is the durable step after the effects, and cut short it left
// every record in progress, to be taken over and applied again after the
// lease. Fails before the fix (context canceled; the keys in progress).
func TestFinishCompletesThoughCancelledDuring(t *testing.T) {
	s, _ := newMem(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r := newRunner(t, cancelDuring{s, cancel})
	reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}}
	pb := r.StartBatch(ctx, reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
		return []byte{'a' + byte(i)}, nil
	})
	_, errs := pb.Finish()
	for i, id := range []string{"a", "b"} {
		if errs[i] != nil {
			t.Errorf("%s: %v, want completed", id, errs[i])
		}
		if c, _ := s.Claim(context.Background(), k(id), "", time.Second); c.Outcome != dedup.Duplicate {
			t.Errorf("%s after the cancel is %v, want completed", id, c.Outcome)
		}
	}
}

// TestBatchHeartbeatBeatsUntilFinish: while a batch waits for its Finish,
// its heartbeat extends every waiting claim each third of the lease, beat
// after beat; Finish waits for a beat in progress, and no extension starts
// once it returned.
func TestBatchHeartbeatBeatsUntilFinish(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		var (
			mu    sync.Mutex
			calls int
			hold  chan struct{} // when set, an extension waits for it to close
		)
		entered := make(chan struct{}, 1)
		store := extendHook{Store: s, extend: func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
			mu.Lock()
			calls++
			h := hold
			mu.Unlock()
			if h != nil {
				select {
				case entered <- struct{}{}:
				default:
				}
				<-h
			}
			return s.Extend(ctx, c, lease)
		}}
		count := func() int {
			mu.Lock()
			defer mu.Unlock()
			return calls
		}
		r := newRunner(t, store, dedup.WithLease(30*time.Second))
		reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}
		var h byID
		pb := r.StartBatch(context.Background(), reqs, h.handler(reqs))
		time.Sleep(25 * time.Second) // beats at 10 s and 20 s
		synctest.Wait()
		if n := count(); n != 6 {
			t.Fatalf("%d extensions after two beats of three waiting claims, want 6", n)
		}
		mu.Lock()
		hold = make(chan struct{})
		mu.Unlock()
		time.Sleep(5 * time.Second) // the third beat, at 30 s, waits in its first extension
		<-entered
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			pb.Finish()
		}()
		synctest.Wait()
		select {
		case <-finished:
			t.Fatal("Finish returned while an extension was in flight")
		default:
		}
		close(hold)
		<-finished
		n := count()
		time.Sleep(time.Minute)
		synctest.Wait()
		if m := count(); m != n {
			t.Fatalf("%d extensions after Finish returned", m-n)
		}
		for _, q := range reqs {
			if h.count(q.Key.ID) != 1 {
				t.Fatalf("%s ran %d times", q.Key.ID, h.count(q.Key.ID))
			}
		}
	})
}

// TestBatchHeartbeatKeepsItsCadenceWhenExtensionsTakeTime: a beat that
// takes time (each extension a round trip) does not push the next one
// back: beats start each third of the lease, as a ticker's would, so a
// claim is extended every third of the lease however long a beat takes
// (under a third), and is not found stale when its turn comes. Here three
// claims wait while the first handler runs for 41.5 s of a 30 s lease,
// each extension taking 2 s: beats at 10, 20, 30 and 40 s keep b's last
// extension at most 10 s old; beats re-armed a third of the lease after
// the previous one ended (10, 26, 42 s) leave b 15.5 s without one when
// it runs, over half the lease: it is released and done alone.
func TestBatchHeartbeatKeepsItsCadenceWhenExtensionsTakeTime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s, err := memstore.New()
		if err != nil {
			t.Fatal(err)
		}
		defer s.Close()
		store := extendHook{Store: s, extend: func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
			time.Sleep(2 * time.Second) // the round trip
			return s.Extend(ctx, c, lease)
		}}
		r := newRunner(t, store, dedup.WithLease(30*time.Second))
		reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}, {Key: k("d")}}
		var mu sync.Mutex
		runs := map[string]int{}
		pb := r.StartBatch(context.Background(), reqs, func(ctx context.Context, i int, c dedup.Claim) ([]byte, error) {
			mu.Lock()
			runs[reqs[i].Key.ID]++
			mu.Unlock()
			if i == 0 {
				time.Sleep(41*time.Second + 500*time.Millisecond)
			}
			return nil, nil
		})
		clean, alone := pb.Clean(), pb.RunsHandlers()
		_, errs := pb.Finish()
		for i, err := range errs {
			if err != nil {
				t.Errorf("%s: %v", reqs[i].Key.ID, err)
			}
		}
		if !clean || alone {
			t.Fatalf("clean %v, runs handlers alone %v: a waiting claim went stale while beats extended it", clean, alone)
		}
		for _, q := range reqs {
			if runs[q.Key.ID] != 1 {
				t.Fatalf("%s ran %d times", q.Key.ID, runs[q.Key.ID])
			}
		}
	})
}

// TestBatchFinishDoesNotWaitOnAHungExtension: Finish stops the heartbeat
// and waits for a beat in progress, but an extension hung on a frozen
// store (one that returns only when its context ends, as a driver without
// a timeout does) must not hold Finish, or the pipeline goroutine that
// calls it, for as long as the batch's context lives: the batch is done
// with its claims, so Finish ends the extension's context.
func TestBatchFinishDoesNotWaitOnAHungExtension(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store, entered := frozenExtends(t)
		r := newRunner(t, store, dedup.WithLease(30*time.Second))
		reqs := []dedup.ClaimRequest{{Key: k("a")}, {Key: k("b")}, {Key: k("c")}}
		var h byID
		ctx, cancel := context.WithCancel(context.Background()) // the consumer runs on
		defer cancel()
		pb := r.StartBatch(ctx, reqs, h.handler(reqs))
		<-entered // the first beat, at 10 s, hangs in its first extension
		_, errs := pb.Finish()
		for i, err := range errs {
			if err != nil {
				t.Errorf("%s: %v", reqs[i].Key.ID, err)
			}
		}
	})
}

// TestDoHeartbeatDoesNotHoldDoOnAHungExtension: Do's heartbeat
// (WithHeartbeat) must not hold Do, once its handler returned, for as
// long as ctx lives because an extension hangs on a frozen store: the
// handler is done with its claim, so Do ends the extension's context.
func TestDoHeartbeatDoesNotHoldDoOnAHungExtension(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		store, entered := frozenExtends(t)
		r := newRunner(t, store, dedup.WithLease(30*time.Second), dedup.WithHeartbeat(time.Second))
		ctx, cancel := context.WithCancel(context.Background()) // the consumer runs on
		defer cancel()
		if _, err := r.Do(ctx, k("a"), "", func(ctx context.Context) ([]byte, error) {
			<-entered // the heartbeat's extension hangs
			return nil, nil
		}); err != nil {
			t.Fatal(err)
		}
	})
}

// frozenExtends is a memstore whose Extend hangs until its context ends
// (a frozen store, reached through a driver without a call timeout); the
// channel receives when the first extension begins.
func frozenExtends(t *testing.T) (extendHook, <-chan struct{}) {
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	entered := make(chan struct{}, 1)
	return extendHook{Store: s, extend: func(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
		select {
		case entered <- struct{}{}:
		default:
		}
		<-ctx.Done() // the store froze
		return dedup.Claim{}, ctx.Err()
	}}, entered
}

// TestReleasedBatchMemoryIsReused: a batch released after Finish hands
// its memory to the runner's next batch, which returns exactly what
// DoBatch returns for its requests (nothing of the first batch's results
// or errors left in it); a batch not released, or released before its
// Finish (which does nothing), keeps its memory: the next batch is made
// in other memory and the first one's slices stay as Finish returned
// them.
func TestReleasedBatchMemoryIsReused(t *testing.T) {
	ctx := context.Background()
	s, _ := newMem(t)
	r := newRunner(t, s, dedup.WithClassifier(classify))
	c, _ := s.Claim(ctx, k("rdup"), "", time.Minute)
	s.Complete(ctx, c, []byte("stored"), time.Hour)
	var h byID
	// The first batch: errors and results where the second has none.
	first := []dedup.ClaimRequest{{Key: k("fails")}, {Key: k("rdup")}, {Key: dedup.Key{Scope: "test", ID: "bad\x00id"}}, {Key: k("r1")}}
	pb := r.StartBatch(ctx, first, h.handler(first))
	res1, errs1 := pb.Finish()
	if errs1[0] == nil || !res1[1].Duplicate || errs1[2] == nil || errs1[3] != nil {
		t.Fatalf("first batch: %+v %v", res1, errs1)
	}
	at := &res1[0]
	pb.Release()
	pb.Release() // a second Release does nothing

	// An invalid key where the first batch had a duplicate: its Result is
	// the zero one, not the duplicate's left in the memory.
	second := []dedup.ClaimRequest{{Key: k("r2")}, {Key: dedup.Key{Scope: "test", ID: "bad\x01id"}}, {Key: k("r4")}}
	s2, _ := newMem(t)
	var h2 byID
	want, wantErrs := newRunner(t, s2, dedup.WithClassifier(classify)).DoBatch(ctx, second, h2.handler(second))
	pb = r.StartBatch(ctx, second, h.handler(second))
	res2, errs2 := pb.Finish()
	if &res2[0] != at {
		t.Error("the second batch was not made in the memory the first one released")
	}
	for i := range second {
		if g, w := fmt.Sprintf("%+v %v", res2[i], errs2[i]), fmt.Sprintf("%+v %v", want[i], wantErrs[i]); g != w {
			t.Errorf("request %d in released memory: %s, want %s", i, g, w)
		}
	}

	// Not released, or released before its Finish (which does nothing):
	// the batch keeps its memory.
	third := []dedup.ClaimRequest{{Key: k("r5")}, {Key: k("r6")}}
	pb3 := r.StartBatch(ctx, third, h.handler(third))
	pb3.Release()
	res3, errs3 := pb3.Finish()
	snap := fmt.Sprintf("%+v %v %+v %v", res2, errs2, res3, errs3)
	fourth := []dedup.ClaimRequest{{Key: k("fails")}, {Key: k("rdup")}}
	res4, _ := r.DoBatch(ctx, fourth, h.handler(fourth))
	if &res4[0] == &res2[0] || &res4[0] == &res3[0] {
		t.Error("a batch was made in the memory of a batch not released")
	}
	if got := fmt.Sprintf("%+v %v %+v %v", res2, errs2, res3, errs3); got != snap {
		t.Errorf("the results of batches not released changed:\n %s\nwere\n %s", got, snap)
	}
}

// TestReleaseAfterCutShortFinishKeepsMemory: a Finish cut short (a hook
// panicked in it, before the heartbeat was stopped) did not finish the
// batch, so a Release after it (as a deferred Release runs once the
// panic was recovered) does nothing: the batch's heartbeat may still
// write the claims' state, and a later batch made in that memory would
// have it overwritten. Fails when Release hands back the memory of a
// batch whose Finish did not return.
func TestReleaseAfterCutShortFinishKeepsMemory(t *testing.T) {
	ctx := context.Background()
	s, _ := newMem(t)
	var boom atomic.Bool
	r := newRunner(t, s, dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
		if f, ok := e.(dedup.FinishEvent); ok && f.Op == "complete" && boom.Load() {
			panic("hook bug")
		}
	})))
	var h byID
	// A batch finished and released: its memory is the runner's next.
	first := []dedup.ClaimRequest{{Key: k("cs1")}, {Key: k("cs2")}}
	pb := r.StartBatch(ctx, first, h.handler(first))
	res1, _ := pb.Finish()
	at := &res1[0]
	pb.Release()

	// The next batch is made in it (two claims: a heartbeat runs), and its
	// Finish is cut short by the hook's panic.
	second := []dedup.ClaimRequest{{Key: k("cs3")}, {Key: k("cs4")}}
	pb = r.StartBatch(ctx, second, h.handler(second))
	boom.Store(true)
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("Finish did not panic with its hook")
			}
		}()
		defer pb.Release()
		pb.Finish()
	}()
	boom.Store(false)

	third := []dedup.ClaimRequest{{Key: k("cs5")}, {Key: k("cs6")}}
	res3, errs3 := r.DoBatch(ctx, third, h.handler(third))
	if &res3[0] == at {
		t.Error("a batch was made in the memory of a batch whose Finish was cut short")
	}
	if errs3[0] != nil || errs3[1] != nil {
		t.Errorf("third batch: %v", errs3)
	}
}

// TestFinishCutShortStopsHeartbeat: a Finish cut short by a panic (a
// hook's, recovered by the caller) still stops the batch's heartbeat.
// It went on re-arming its timer every beat for the life of the process,
// holding the batch and its memory, and extending any claim still
// waiting, so that claim's lease never ended and its message was never
// redelivered.
func TestFinishCutShortStopsHeartbeat(t *testing.T) {
	ctx := context.Background()
	s, _ := newMem(t)
	r := newRunner(t, s, dedup.WithLease(time.Minute), dedup.WithHeartbeat(time.Millisecond),
		dedup.WithHooks(dedup.HookFunc(func(_ context.Context, e any) {
			if f, ok := e.(dedup.FinishEvent); ok && f.Op == "complete" {
				panic("hook bug")
			}
		})))
	var h byID
	reqs := []dedup.ClaimRequest{{Key: k("hb1")}, {Key: k("hb2")}}
	pb := r.StartBatch(ctx, reqs, h.handler(reqs))
	func() {
		defer func() {
			if recover() == nil {
				t.Fatal("Finish did not panic with its hook")
			}
		}()
		pb.Finish()
	}()
	if started, stopped := dedup.Heartbeat(pb); !started || !stopped {
		t.Fatalf("heartbeat started %v, stopped %v: the heartbeat of a batch whose Finish was cut short must stop", started, stopped)
	}
}
