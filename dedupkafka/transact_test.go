package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// outside is a system outside Kafka that the handlers change (a table, a
// payment provider): it counts effects per message ID and answers a
// lookup by ID, which a handler uses to reconcile when it is told that an
// earlier run may have happened (TxInput.Attempt > 1).
type outside struct {
	mu      sync.Mutex
	applied map[string]int
	// blind counts effects applied again to an ID without the handler
	// being told an earlier run may have happened: the transactor's fault.
	blind int
	// reconciled counts runs told Attempt > 1 that found the effect done.
	reconciled int
}

func newOutside() *outside { return &outside{applied: map[string]int{}} }

// run applies id's effect once: on a first attempt blindly (a repeat is
// counted as blind), on a later one after a lookup.
func (o *outside) run(in TxInput) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := in.Message.ID
	if o.applied[id] > 0 {
		if in.Attempt > 1 {
			o.reconciled++
			return
		}
		o.blind++
	}
	o.applied[id]++
}

func (o *outside) check(t *testing.T, n int) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.blind != 0 {
		t.Errorf("%d effects repeated without the handler being told an earlier run may have happened", o.blind)
	}
	for i := range n {
		if id := fmt.Sprintf("m%d", i); o.applied[id] != 1 {
			t.Errorf("%s took effect %d times, want 1", id, o.applied[id])
		}
	}
}

func (o *outside) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.applied)
}

// transform is the handler of the tests: the outside effect, then one
// output record per input, carrying the input's ID.
func transform(o *outside, fail func(TxInput) error) TxHandler {
	return func(ctx context.Context, in TxInput) ([]*kgo.Record, error) {
		if fail != nil {
			if err := fail(in); err != nil {
				return nil, err
			}
		}
		o.run(in)
		return []*kgo.Record{{Topic: "out", Key: in.Record.Key, Value: in.Record.Value,
			Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: []byte("out-" + in.Message.ID)}}}}, nil
	}
}

// readCommitted reads topic from its start under read_committed until it
// has at least want records and a further poll brings nothing new; it
// returns the count per Dedup-Msg-Id.
func readCommitted(t *testing.T, seeds []string, topic string, want int) map[string]int {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ConsumeTopics(topic), kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[string]int{}
	total := 0
	deadline := time.Now().Add(time.Minute)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		fs := cl.PollFetches(ctx)
		cancel()
		n := 0
		fs.EachRecord(func(r *kgo.Record) {
			n++
			for _, h := range r.Headers {
				if h.Key == HeaderMsgID {
					got[string(h.Value)]++
				}
			}
		})
		total += n
		if n == 0 && total >= want {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("read %d committed records of %s, want %d", total, topic, want)
		}
	}
}

func checkOutputs(t *testing.T, got map[string]int, n int) {
	t.Helper()
	for i := range n {
		if id := fmt.Sprintf("out-m%d", i); got[id] != 1 {
			t.Errorf("output %s visible %d times under read_committed, want 1", id, got[id])
		}
	}
	if len(got) != n {
		t.Errorf("%d distinct outputs, want %d", len(got), n)
	}
}

func newTransactor(t *testing.T, seeds []string, txnID string, store *memstore.Store, h TxHandler, opts ...TxOption) *Transactor {
	t.Helper()
	tr, err := NewTransactor(seeds, "tx-group", txnID, []string{"in"}, store, "kafka-tx", h, append([]TxOption{
		WithTxLogger(quiet), WithTxLease(2 * time.Second), WithTxBackoff(5*time.Millisecond, 500*time.Millisecond), WithTxMaxPollRecords(50),
		WithTxClientOptions(kgo.HeartbeatInterval(100*time.Millisecond), kgo.SessionTimeout(6*time.Second),
			kgo.RebalanceTimeout(6*time.Second), kgo.FetchMaxWait(50*time.Millisecond))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func runTx(t *testing.T, tr *Transactor) func() error {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- tr.Run(context.Background()) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() {
			tr.Close()
			err = <-errc
		})
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

// Transactions aborted in every way the transactor meets alone (a forced
// abort before the commit, offset commits inside the transaction refused,
// output produces refused by the broker, handler failures before and after the outside effect) apply each
// input's outside effect once and leave each output visible once under
// read_committed; the outputs of an aborted transaction are produced again
// from memory, without running the handler.
func TestTransactorAbortsApplyOnce(t *testing.T) {
	const n = 300
	c, seeds := cluster(t, 4, "in", "out")
	produce(t, seeds, "in", n, 16, nil)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	o := newOutside()
	var before, after sync.Map // IDs failed once before / after the effect
	h := transform(o, func(in TxInput) error {
		var i int
		fmt.Sscanf(in.Message.ID, "m%d", &i)
		if i%11 == 0 {
			if _, seen := before.LoadOrStore(in.Message.ID, true); !seen {
				return NotStarted(errors.New("refused before any effect"))
			}
		}
		return nil
	})
	// Fail after the effect: wrap the handler.
	inner := h
	h = func(ctx context.Context, in TxInput) ([]*kgo.Record, error) {
		out, err := inner(ctx, in)
		var i int
		fmt.Sscanf(in.Message.ID, "m%d", &i)
		if err == nil && i%13 == 5 {
			if _, seen := after.LoadOrStore(in.Message.ID, true); !seen {
				return nil, errors.New("timed out after the effect")
			}
		}
		return out, err
	}
	var txns atomic.Int64
	tr := newTransactor(t, seeds, "tx-a", store, h, func() TxOption {
		return txOption(func(c *txConfig) { c.abortHook = func() bool { return txns.Add(1)%3 == 0 } })
	}())
	c.Fault(txnCommitFault(3))
	// Produce requests of outputs refused: the transaction aborts with the
	// records in flight.
	c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Topic: "out", Err: kerr.InvalidRecord, Count: 2})
	stop := runTx(t, tr)
	waitFor(t, "every input committed", func() bool { return tr.Stats().Applied+tr.Stats().Duplicates >= n && o.count() == n })
	allCommitted(t, seeds, "tx-group", "in")
	got := readCommitted(t, seeds, "out", n)
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.check(t, n)
	checkOutputs(t, got, n)
	st := tr.Stats()
	if st.Aborts < 5 || st.Reused == 0 || st.Released == 0 || st.HandlerErrors == 0 || st.ProduceErrors == 0 {
		t.Errorf("the faults did not happen as planned: %+v", st)
	}
	if o.reconciled == 0 {
		t.Errorf("no handler was told to reconcile after failing past its effect: %+v", st)
	}
	if st.Applied != n {
		t.Errorf("%d keys completed after their commit, want %d (%+v)", st.Applied, n, st)
	}
}

// txnCommitFault refuses the offsets of count transactions with
// REBALANCE_IN_PROGRESS: the session aborts them.
func txnCommitFault(count int) kfake.Fault {
	return kfake.Fault{Keys: []kmsg.Key{kmsg.TxnOffsetCommit}, Err: kerr.RebalanceInProgress, Count: count}
}

// Members join and leave mid-run: transactions aborted by the rebalances
// leave no output under read_committed, keys whose partition moved while
// their transaction was open are taken over after their lease with
// TakenOver set, and every input's outside effect and output happen once.
func TestTransactorRebalance(t *testing.T) {
	const n = 1200
	_, seeds := cluster(t, 8, "in", "out")
	produce(t, seeds, "in", n, 64, nil)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	o := newOutside()
	slow := func(TxInput) error { time.Sleep(200 * time.Microsecond); return nil }
	a := newTransactor(t, seeds, "tx-a", store, transform(o, slow))
	stopA := runTx(t, a)
	waitFor(t, "a's first commits", func() bool { return o.count() >= n/6 })
	b := newTransactor(t, seeds, "tx-b", store, transform(o, slow))
	runTx(t, b)
	waitFor(t, "half applied", func() bool { return o.count() >= n/2 })
	c := newTransactor(t, seeds, "tx-c", store, transform(o, slow))
	runTx(t, c)
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "every input applied", func() bool { return o.count() == n })
	allCommitted(t, seeds, "tx-group", "in")
	got := readCommitted(t, seeds, "out", n)
	o.check(t, n)
	checkOutputs(t, got, n)
	sa, sb, sc := a.Stats(), b.Stats(), c.Stats()
	if applied := sa.Applied + sb.Applied + sc.Applied; applied != n {
		t.Errorf("%d keys completed, want %d", applied, n)
	}
	// A handler is told to reconcile only for a claim some member left to
	// its lease (its transaction aborted after the effect).
	if left := sa.LeftToLease + sb.LeftToLease + sc.LeftToLease; uint64(o.reconciled) > left {
		t.Errorf("%d handlers reconciled, but only %d claims were left to their lease", o.reconciled, left)
	}
	if sa.Commits == 0 || sb.Commits == 0 || sc.Commits == 0 {
		t.Errorf("a member never committed: a %+v, b %+v, c %+v", sa, sb, sc)
	}
	t.Logf("a %+v\nb %+v\nc %+v\nreconciled %d", sa, sb, sc, o.reconciled)
}

func TestNewTransactorArguments(t *testing.T) {
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	h := func(context.Context, TxInput) ([]*kgo.Record, error) { return nil, nil }
	seeds := []string{"127.0.0.1:1"}
	for name, f := range map[string]func() (*Transactor, error){
		"no brokers":  func() (*Transactor, error) { return NewTransactor(nil, "g", "x", []string{"t"}, store, "s", h) },
		"no group":    func() (*Transactor, error) { return NewTransactor(seeds, "", "x", []string{"t"}, store, "s", h) },
		"no txn id":   func() (*Transactor, error) { return NewTransactor(seeds, "g", "", []string{"t"}, store, "s", h) },
		"bad topic":   func() (*Transactor, error) { return NewTransactor(seeds, "g", "x", []string{"a b"}, store, "s", h) },
		"no store":    func() (*Transactor, error) { return NewTransactor(seeds, "g", "x", []string{"t"}, nil, "s", h) },
		"no handler":  func() (*Transactor, error) { return NewTransactor(seeds, "g", "x", []string{"t"}, store, "s", nil) },
		"empty scope": func() (*Transactor, error) { return NewTransactor(seeds, "g", "x", []string{"t"}, store, "", h) },
		"bad lease": func() (*Transactor, error) {
			return NewTransactor(seeds, "g", "x", []string{"t"}, store, "s", h, WithTxLease(0))
		},
		"bad backoff": func() (*Transactor, error) {
			return NewTransactor(seeds, "g", "x", []string{"t"}, store, "s", h, WithTxBackoff(time.Second, time.Millisecond))
		},
	} {
		if tr, err := f(); err == nil || tr != nil {
			t.Errorf("%s: got %v, %v; want an argument error", name, tr, err)
		}
	}
}

// A handler whose first run failed past its effect and whose second run
// failed before any effect (NotStarted: the lookup it reconciles with was
// refused) must not lose the first run: the claim is kept, so the third
// run is still told an earlier one may have happened (Attempt > 1) and
// reconciles instead of repeating the effect blind.
func TestTransactorNotStartedAfterEffectKeepsClaim(t *testing.T) {
	const n = 40
	_, seeds := cluster(t, 2, "in", "out")
	produce(t, seeds, "in", n, 4, nil)
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	o := newOutside()
	var mu sync.Mutex
	runs := map[string]int{}
	h := func(ctx context.Context, in TxInput) ([]*kgo.Record, error) {
		mu.Lock()
		runs[in.Message.ID]++
		r := runs[in.Message.ID]
		mu.Unlock()
		if r == 2 && in.Message.ID == "m7" {
			return nil, NotStarted(errors.New("lookup refused before any effect"))
		}
		out, err := transform(o, nil)(ctx, in)
		if r == 1 && in.Message.ID == "m7" {
			return nil, errors.New("timed out after the effect")
		}
		return out, err
	}
	tr := newTransactor(t, seeds, "tx-ns", store, h)
	stop := runTx(t, tr)
	waitFor(t, "every input committed", func() bool { return tr.Stats().Applied+tr.Stats().Duplicates >= n && o.count() == n })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.check(t, n)
}

// offsetClock is a store clock that a test moves forward.
type offsetClock struct {
	mu  sync.Mutex
	off time.Duration
}

func (c *offsetClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return time.Now().Add(c.off)
}

func (c *offsetClock) advance(d time.Duration) {
	c.mu.Lock()
	c.off += d
	c.mu.Unlock()
}

// A claim whose lease this process lost while its handler had already run
// (and failed past its effect) is claimed anew; the new claim must carry
// those runs into Attempt. Here the lost claim's key is taken over by
// another owner, which releases it (its own run did not start), so the
// store's attempt count restarts at 1: a transactor that trusts it tells
// the next run Attempt 1, the handler repeats its effect blind, and a
// NotStarted failure of that run would even release the key.
func TestTransactorLostLeaseCarriesRuns(t *testing.T) {
	const n = 20
	_, seeds := cluster(t, 2, "in", "out")
	produce(t, seeds, "in", n, 4, nil)
	clock := &offsetClock{}
	store, err := memstore.New(memstore.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	const lease = 2 * time.Second
	o := newOutside()
	var mu sync.Mutex
	var attempts []int // of m3, in order
	var intruded atomic.Bool
	h := func(ctx context.Context, in TxInput) ([]*kgo.Record, error) {
		out, err := transform(o, nil)(ctx, in)
		if in.Message.ID != "m3" {
			return out, err
		}
		mu.Lock()
		attempts = append(attempts, in.Attempt)
		mu.Unlock()
		if intruded.CompareAndSwap(false, true) {
			// The effect ran; now the lease runs out (the store's clock
			// moves past it), another owner takes the key over and gives
			// it up, and this run times out.
			clock.advance(lease + time.Second)
			key := in.Message.ID
			c, err := store.Claim(ctx, txKey(key), "", lease)
			if err != nil || !c.TakenOver {
				t.Errorf("the other owner's claim: %+v, %v", c, err)
			} else if err := store.Release(ctx, c); err != nil {
				t.Errorf("the other owner's release: %v", err)
			}
			return nil, errors.New("timed out after the effect")
		}
		return out, err
	}
	tr := newTransactor(t, seeds, "tx-lost", store, h, WithTxLease(lease))
	stop := runTx(t, tr)
	waitFor(t, "every input committed", func() bool { return tr.Stats().Applied+tr.Stats().Duplicates >= n && o.count() == n })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.check(t, n)
	mu.Lock()
	defer mu.Unlock()
	if len(attempts) < 2 || attempts[0] != 1 || attempts[1] < 2 {
		t.Errorf("m3's runs were told attempts %v, want 1 and then more", attempts)
	}
	if o.reconciled == 0 {
		t.Errorf("the run after the lost lease did not reconcile (attempts %v)", attempts)
	}
}

// txKey is the dedup key newTransactor's transactors claim for id.
func txKey(id string) dedup.Key { return dedup.Key{Scope: "kafka-tx", ID: id} }
