package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/redisstore"
)

// errCrashed is what a gated store returns once the test "crashed" it.
var errCrashed = errors.New("process crashed")

// gated is a real redisstore whose batch completions the test holds: a
// CompleteBatch call waits for release (once closed, calls go through),
// and after crash every call fails before it reaches Redis, as the calls
// of a process that died. It logs the batch calls in order.
type gated struct {
	*redisstore.Store
	release chan struct{}
	entered chan struct{} // a CompleteBatch call is waiting at the gate
	once    sync.Once
	crashed atomic.Bool

	mu        sync.Mutex
	log       []string        // "claim k1,k2", "complete k1,k2" (after it returned)
	completed map[string]bool // IDs whose completion returned nil
}

func newGated(t *testing.T, prefix string) *gated {
	t.Helper()
	s := redistest.Store(t, prefix)
	return &gated{Store: s, release: make(chan struct{}), entered: make(chan struct{}, 16), completed: map[string]bool{}}
}

// open lets every held and later completion go on.
func (g *gated) open() { g.once.Do(func() { close(g.release) }) }

func (g *gated) note(op string, ids []string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.log = append(g.log, op+" "+strings.Join(ids, ","))
}

func (g *gated) logged() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.log)
}

func (g *gated) wasCompleted(id string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.completed[id]
}

func (g *gated) down() error {
	if g.crashed.Load() {
		return &dedup.StoreError{Store: "gated", Op: "call", Err: errCrashed}
	}
	return nil
}

func (g *gated) Claim(ctx context.Context, k dedup.Key, fp dedup.Fingerprint, lease time.Duration) (dedup.Claim, error) {
	if err := g.down(); err != nil {
		return dedup.Claim{}, err
	}
	return g.Store.Claim(ctx, k, fp, lease)
}

func (g *gated) Complete(ctx context.Context, c dedup.Claim, result []byte, ret time.Duration) error {
	if err := g.down(); err != nil {
		return err
	}
	return g.Store.Complete(ctx, c, result, ret)
}

func (g *gated) Release(ctx context.Context, c dedup.Claim) error {
	if err := g.down(); err != nil {
		return err
	}
	return g.Store.Release(ctx, c)
}

func (g *gated) Extend(ctx context.Context, c dedup.Claim, lease time.Duration) (dedup.Claim, error) {
	if err := g.down(); err != nil {
		return dedup.Claim{}, err
	}
	return g.Store.Extend(ctx, c, lease)
}

func (g *gated) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	if err := g.down(); err != nil {
		return nil, err
	}
	ids := make([]string, len(reqs))
	for i, r := range reqs {
		ids[i] = r.Key.ID
	}
	g.note("claim", ids)
	return g.Store.ClaimBatch(ctx, reqs, lease)
}

func (g *gated) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	g.entered <- struct{}{}
	<-g.release
	if err := g.down(); err != nil {
		return nil, err
	}
	errs, err := g.Store.CompleteBatch(ctx, items, ret)
	ids := make([]string, len(items))
	g.mu.Lock()
	for i, it := range items {
		ids[i] = it.Claim.Key.ID
		if err == nil && errs[i] == nil {
			g.completed[it.Claim.Key.ID] = true
		}
	}
	g.mu.Unlock()
	g.note("complete", ids)
	return errs, err
}

// ranLog records handler runs in order.
type ranLog struct {
	mu   sync.Mutex
	runs []string
	over map[string]bool // IDs run with Delivery.TakenOver
}

func (r *ranLog) add(id string, d consumer.Delivery) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.runs = append(r.runs, id)
	if d.TakenOver {
		if r.over == nil {
			r.over = map[string]bool{}
		}
		r.over[id] = true
	}
}

func (r *ranLog) snapshot() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.runs)
}

func (r *ranLog) count(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, x := range r.runs {
		if x == id {
			n++
		}
	}
	return n
}

func (r *ranLog) takenOver(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.over[id]
}

// uniquePrefix is a Redis key prefix of this test alone.
func uniquePrefix(t *testing.T) string {
	return "pipetest:" + t.Name() + ":" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
}

// TestPipelineOverlapsAndDecidesAfterCompletion: on Redis, the second
// batch is claimed and its handlers run while the first batch's
// completion is held; the first batch is decided only after its
// completion returned, every Ack is of a key whose completion returned
// nil, and a completion that finds its lease lost (its record deleted
// while it waited) is a Retry, never an Ack.
func TestPipelineOverlapsAndDecidesAfterCompletion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGated(t, uniquePrefix(t))
	var ran ranLog
	name := "pipe-overlap"
	p, err := consumer.New(name, g, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ran.add(m.ID, d)
		if m.ID == "a4" { // a2 ran and waits for its completion: its record goes
			c := g.Client()
			if err := c.Do(ctx, c.B().Del().Key(g.RedisKey(dedup.Key{Scope: name, ID: "a2"})).Build()).Error(); err != nil {
				return nil, err
			}
		}
		return []byte("ok"), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	var (
		mu      sync.Mutex
		order   []string // "A", "B": done calls
		decided = map[string]consumer.Decision{}
		early   []string // IDs acknowledged before their completion returned
	)
	done := func(batch string, ms []*consumer.Message) func([]consumer.Decision) {
		return func(ds []consumer.Decision) {
			mu.Lock()
			defer mu.Unlock()
			order = append(order, batch)
			for i, d := range ds {
				decided[ms[i].ID] = d
				if d.Action == consumer.Ack && !g.wasCompleted(ms[i].ID) {
					early = append(early, ms[i].ID)
				}
			}
		}
	}
	a, b := msgs("a1", "a2", "a3", "a4"), msgs("b1", "b2", "b3", "b4")
	if !pl.Submit(ctx, a, done("A", a)) {
		t.Error("batch A not clean: every handler succeeded")
	}
	<-g.entered // A's completion is held
	pl.Submit(ctx, b, done("B", b))
	// B was claimed and its handlers ran while A's completion is held.
	if got, want := ran.snapshot(), []string{"a1", "a2", "a3", "a4", "b1", "b2", "b3", "b4"}; !slices.Equal(got, want) {
		t.Errorf("handlers ran %v, want %v", got, want)
	}
	if got := g.logged(); !slices.Equal(got, []string{"claim a1,a2,a3,a4", "claim b1,b2,b3,b4"}) {
		t.Errorf("store calls before A's completion %v, want both claims", got)
	}
	mu.Lock()
	if len(order) != 0 {
		t.Errorf("decided %v while A's completion was held", order)
	}
	mu.Unlock()
	g.open()
	pl.Wait()

	if !slices.Equal(order, []string{"A", "B"}) {
		t.Errorf("done calls %v, want A then B", order)
	}
	if len(early) > 0 {
		t.Errorf("acknowledged before their completion returned: %v", early)
	}
	for _, id := range []string{"a1", "a3", "a4", "b1", "b2", "b3", "b4"} {
		if d := decided[id]; d.Action != consumer.Ack || d.Duplicate {
			t.Errorf("%s: %v %v, want a fresh Ack", id, d.Action, d.Err)
		}
	}
	if d := decided["a2"]; d.Action != consumer.Retry || !errors.Is(d.Err, dedup.ErrLeaseLost) {
		t.Errorf("a2 (its record deleted before its completion): %v %v, want Retry with a lost lease", d.Action, d.Err)
	}
}

// TestPipelineWaitsForAKeyInFlight: a batch with a key of a batch whose
// completion is still in flight is claimed only after that batch was
// decided, so the key is a duplicate (as one batch after the other), not
// found in progress. The held completion is let go either by a claim of
// the second batch (which would find the key in progress: the test then
// fails) or, if no claim comes, after a pause.
func TestPipelineWaitsForAKeyInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGated(t, uniquePrefix(t))
	var ran ranLog
	p, err := consumer.New("pipe-key", g, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ran.add(m.ID, d)
		return []byte("r-" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	var got []consumer.Decision
	pl.Submit(ctx, msgs("k1", "k2"), func([]consumer.Decision) {})
	<-g.entered
	claims := func() int {
		n := 0
		for _, l := range g.logged() {
			if strings.HasPrefix(l, "claim") {
				n++
			}
		}
		return n
	}
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		// Let A's completion go once B is claimed (wrong) or after a pause
		// with no claim (right: B waits for A).
		deadline := time.After(300 * time.Millisecond)
		for claims() < 2 {
			select {
			case <-deadline:
				g.open()
				return
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
		g.open()
	}()
	pl.Submit(ctx, msgs("k2", "k3"), func(ds []consumer.Decision) { got = ds })
	pl.Wait()

	if len(got) != 2 {
		t.Fatalf("decisions %v", got)
	}
	if d := got[0]; d.Action != consumer.Ack || !d.Duplicate || string(d.Result) != "r-k2" {
		t.Errorf("k2 again: %v duplicate=%v result=%q err=%v, want a duplicate with the first run's result", d.Action, d.Duplicate, d.Result, d.Err)
	}
	if d := got[1]; d.Action != consumer.Ack || d.Duplicate {
		t.Errorf("k3: %v %v", d.Action, d.Err)
	}
	if n := ran.count("k2"); n != 1 {
		t.Errorf("k2 ran %d times, want 1", n)
	}
	if l := g.logged(); len(l) != 4 || l[1] != "complete k1,k2" || l[2] != "claim k2,k3" {
		t.Errorf("store calls %v, want the second claim after the first completion", l)
	}
}

// TestPipelineCrashBetweenClaimAndCompletionLosesNothing: the process
// "crashes" after batch B was claimed and ran and before A's (and B's)
// completion reached Redis. Nothing is acknowledged; a new process given
// the redeliveries finds the claims in progress until their lease ends,
// takes them over (the handler sees TakenOver) and applies and completes
// every message; a delivery after that is a duplicate.
func TestPipelineCrashBetweenClaimAndCompletionLosesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	prefix := uniquePrefix(t)
	g := newGated(t, prefix)
	var ran ranLog
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ran.add(m.ID, d)
		return nil, nil
	}
	const lease = 400 * time.Millisecond
	opts := []consumer.Option{consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithLease(lease),
		consumer.WithBackoff(20*time.Millisecond, 100*time.Millisecond)}
	p, err := consumer.New("pipe-crash", g, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	var acked atomic.Int64
	count := func(ds []consumer.Decision) {
		for _, d := range ds {
			if d.Action == consumer.Ack {
				acked.Add(1)
			}
		}
	}
	all := []string{"a1", "a2", "a3", "b1", "b2", "b3"}
	pl.Submit(ctx, msgs(all[:3]...), count)
	<-g.entered
	pl.Submit(ctx, msgs(all[3:]...), count)
	g.crashed.Store(true) // before either completion reaches Redis
	g.open()
	pl.Wait()
	if n := acked.Load(); n != 0 {
		t.Fatalf("%d messages acknowledged though no completion was written", n)
	}
	if got := ran.snapshot(); !slices.Equal(got, all) {
		t.Fatalf("before the crash the handlers ran %v, want %v", got, all)
	}

	// The new process: the same Redis, redeliveries until every message
	// is acknowledged.
	g2 := &gated{Store: g.Store, release: make(chan struct{}), entered: make(chan struct{}, 1024), completed: map[string]bool{}}
	g2.open()
	p2, err := consumer.New("pipe-crash", g2, h, opts...)
	if err != nil {
		t.Fatal(err)
	}
	pl2 := p2.NewPipeline(2)
	left := slices.Clone(all)
	deadline := time.Now().Add(30 * time.Second)
	for len(left) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("not acknowledged after 30 s: %v", left)
		}
		var mu sync.Mutex
		var still []string
		batch := msgs(left...)
		for _, m := range batch {
			m.Delivery = 2
		}
		pl2.Submit(ctx, batch, func(ds []consumer.Decision) {
			mu.Lock()
			defer mu.Unlock()
			for i, d := range ds {
				if d.Action != consumer.Ack {
					still = append(still, batch[i].ID)
				}
			}
		})
		pl2.Wait()
		left = still
		if len(left) > 0 {
			time.Sleep(lease / 4)
		}
	}
	for _, id := range all {
		if n := ran.count(id); n != 2 {
			t.Errorf("%s ran %d times, want 2 (before the crash and once taken over)", id, n)
		}
		if !ran.takenOver(id) {
			t.Errorf("%s: the run after the crash did not see TakenOver: the crashed claim was lost", id)
		}
	}
	ds := p2.ProcessBatch(ctx, msgs(all...))
	for i, d := range ds {
		if d.Action != consumer.Ack || !d.Duplicate {
			t.Errorf("%s delivered again: %v %v, want a duplicate", all[i], d.Action, d.Err)
		}
	}
}

// TestPipelineBatchRunningHandlersLateIsABarrier: a batch whose
// decisions run a handler (a key repeated in it, run again after its first
// run failed) is one the next batch waits for, so handlers never overlap
// and keep their order. The held completion of the first batch is let go
// by a claim of the second (which must not come first: the test then
// fails) or, if none comes, after a pause.
func TestPipelineBatchRunningHandlersLateIsABarrier(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	g := newGated(t, uniquePrefix(t))
	var ran ranLog
	var running, overlapped atomic.Int32
	var xRuns atomic.Int32
	p, err := consumer.New("pipe-barrier", g, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if running.Add(1) > 1 {
			overlapped.Add(1)
		}
		defer running.Add(-1)
		ran.add(m.ID, d)
		if m.ID == "x" && xRuns.Add(1) == 1 {
			return nil, consumer.Transient(errors.New("busy"))
		}
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	var first, second []consumer.Decision
	pl.Submit(ctx, msgs("x", "a2", "x"), func(ds []consumer.Decision) { first = ds })
	<-g.entered // a2's completion is held
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		deadline := time.After(300 * time.Millisecond)
		for {
			n := 0
			for _, l := range g.logged() {
				if strings.HasPrefix(l, "claim") {
					n++
				}
			}
			if n >= 2 {
				break
			}
			select {
			case <-deadline:
				g.open()
				return
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
		g.open()
	}()
	pl.Submit(ctx, msgs("b1"), func(ds []consumer.Decision) { second = ds })
	pl.Wait()

	if got, want := ran.snapshot(), []string{"x", "a2", "x", "b1"}; !slices.Equal(got, want) {
		t.Errorf("handlers ran %v, want %v (the repeated x in its turn before the next batch)", got, want)
	}
	if n := overlapped.Load(); n != 0 {
		t.Errorf("%d handler runs overlapped another", n)
	}
	if len(first) != 3 || first[0].Action != consumer.Retry || first[1].Action != consumer.Ack || first[2].Action != consumer.Ack {
		t.Errorf("first batch decisions %+v, want Retry, Ack, Ack", first)
	}
	if len(second) != 1 || second[0].Action != consumer.Ack {
		t.Errorf("second batch decisions %+v", second)
	}
}

// orderedGate is a real redisstore whose batch completions each wait for
// their batch's turn: the completion of batch k (its keys are "k<k>-<i>")
// waits until proceed[k] is closed.
type orderedGate struct {
	*redisstore.Store
	proceed []chan struct{}
}

func (g *orderedGate) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	if len(items) > 0 {
		id := items[0].Claim.Key.ID
		k, err := strconv.Atoi(id[1:strings.IndexByte(id, '-')])
		if err != nil {
			return nil, err
		}
		<-g.proceed[k]
	}
	return g.Store.CompleteBatch(ctx, items, ret)
}

// TestPipelineReusesNoMemoryInFlight: a pipeline prepares later batches
// in the memory of batches already decided (their items, keys, claim
// requests and decisions); none may be written while its batch is in
// flight. On Redis, with three batches in flight: batch k's completion
// waits until batch k+1 was claimed and ran, and batch k's done waits
// until batch k+2 was claimed and ran (its decisions are read while later
// batches are prepared, claimed, run and completed). Every done must see
// its own batch's decisions, each the Ack of its own message with the
// result its handler returned, every message runs once, and no memory
// held for reuse is a batch's in flight, checked after each Submit and in
// each done. Checked: recycling a batch once its completion returned and
// before it was decided fails the in-flight check; recycling it once its
// handlers ran hangs the test (a later batch overlaps itself and waits).
func TestPipelineReusesNoMemoryInFlight(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const batches, size = 8, 20
	g := &orderedGate{Store: redistest.Store(t, uniquePrefix(t)), proceed: make([]chan struct{}, batches)}
	submitted := make([]chan struct{}, batches)
	for k := range batches {
		g.proceed[k], submitted[k] = make(chan struct{}), make(chan struct{})
	}
	var ran ranLog
	p, err := consumer.New("pipe-reuse", g, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ran.add(m.ID, d)
		return []byte("r:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(3)
	var (
		mu   sync.Mutex
		bad  []string
		seen = map[int]int{}
	)
	for k := range batches {
		ids := make([]string, size)
		for i := range ids {
			ids[i] = "k" + strconv.Itoa(k) + "-" + strconv.Itoa(i)
		}
		ms := msgs(ids...)
		pl.Submit(ctx, ms, func(ds []consumer.Decision) {
			<-submitted[min(k+2, batches-1)] // later batches prepare, claim and run meanwhile
			mu.Lock()
			defer mu.Unlock()
			seen[k]++
			if pl.ReusesInFlight() {
				bad = append(bad, "batch "+strconv.Itoa(k)+" decided: the memory of a batch in flight is up for reuse")
			}
			if len(ds) != size {
				bad = append(bad, "batch "+strconv.Itoa(k)+": "+strconv.Itoa(len(ds))+" decisions")
				return
			}
			for i, d := range ds {
				if d.Action != consumer.Ack || d.Duplicate || d.Key.ID != ids[i] || string(d.Result) != "r:"+ids[i] {
					bad = append(bad, ids[i]+": "+d.Action.String()+" key "+d.Key.ID+" result "+string(d.Result))
				}
			}
		})
		if pl.ReusesInFlight() {
			t.Errorf("batch %d submitted: the memory of a batch in flight is up for reuse", k)
		}
		close(submitted[k])
		if k > 0 {
			close(g.proceed[k-1]) // batch k was claimed and ran: k-1 may complete
		}
	}
	close(g.proceed[batches-1])
	pl.Wait()
	for _, b := range bad {
		t.Error(b)
	}
	for k := range batches {
		if seen[k] != 1 {
			t.Errorf("batch %d: done called %d times, want 1", k, seen[k])
		}
		for i := range size {
			if id := "k" + strconv.Itoa(k) + "-" + strconv.Itoa(i); ran.count(id) != 1 {
				t.Errorf("%s ran %d times, want 1", id, ran.count(id))
			}
		}
	}
}

// TestPipelineRecycledDecisions: decisions handed back with Recycle are
// the memory a later batch is decided in, and that batch gets its own
// decisions, nothing of the earlier batch's left (a duplicate flag, a
// result); decisions not handed back are never written again.
func TestPipelineRecycledDecisions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := consumer.New("pipe-recycle", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return []byte("r:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	run := func(recycle bool, ids ...string) []consumer.Decision {
		var got []consumer.Decision
		pl.Submit(ctx, msgs(ids...), func(ds []consumer.Decision) {
			got = ds
			if recycle {
				pl.Recycle(ds)
			}
		})
		pl.Wait()
		return got
	}
	first := run(true, "a", "b", "c")
	at := &first[0]
	// "a" again: a duplicate, now first where the first batch's was not.
	second := run(false, "d", "a")
	if &second[0] != at {
		t.Error("the second batch was not decided in the decisions the first recycled")
	}
	if d := second[0]; d.Action != consumer.Ack || d.Duplicate || d.Key.ID != "d" || string(d.Result) != "r:d" {
		t.Errorf("d decided %+v in recycled memory", d)
	}
	if d := second[1]; d.Action != consumer.Ack || !d.Duplicate || d.Key.ID != "a" || string(d.Result) != "r:a" {
		t.Errorf("a decided %+v in recycled memory, want a duplicate", d)
	}
	kept := fmt.Sprintf("%+v", second)
	third := run(true, "e", "f")
	if &third[0] == &second[0] {
		t.Error("a batch was decided in decisions not recycled")
	}
	if got := fmt.Sprintf("%+v", second); got != kept {
		t.Errorf("decisions not recycled changed: %s, were %s", got, kept)
	}
}

// TestPipelineRecycleTwiceIsOnce: a slice handed back twice (a done that
// recycles in a deferred call and again on its path, or an adapter and
// its caller both) is kept once: two later batches are never decided in
// the same memory, so the decisions a done kept (not recycled) are not
// overwritten by the batch after it. Fails when Recycle keeps a slice
// each time it is handed back.
func TestPipelineRecycleTwiceIsOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := consumer.New("pipe-recycle-twice", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return []byte("r:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(2)
	run := func(recycles int, ids ...string) []consumer.Decision {
		var got []consumer.Decision
		pl.Submit(ctx, msgs(ids...), func(ds []consumer.Decision) {
			got = ds
			for range recycles {
				pl.Recycle(ds)
			}
		})
		pl.Wait()
		return got
	}
	run(2, "a", "b", "c")
	kept := run(0, "d", "e") // done keeps these
	snap := fmt.Sprintf("%+v", kept)
	next := run(0, "f", "g")
	if &next[0] == &kept[0] {
		t.Error("two batches were decided in one slice recycled twice")
	}
	if got := fmt.Sprintf("%+v", kept); got != snap {
		t.Errorf("decisions kept by done changed: %s, were %s", got, snap)
	}
	if next[0].Key.ID != "f" || next[1].Key.ID != "g" {
		t.Errorf("next batch decided %+v", next)
	}
}
