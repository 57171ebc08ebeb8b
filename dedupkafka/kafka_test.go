package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Every record applied once, partitions consumed, offsets committed to the
// end.
func TestConsumeCommitsToEnd(t *testing.T) {
	_, seeds := cluster(t, 4, "orders")
	const n = 400
	produce(t, seeds, "orders", n, 16, nil)
	eff := newEffects()
	p := processor(t, nil, eff, nil)
	c := newConsumer(t, seeds, "g", "orders", p)
	stop := run(t, c)
	allCommitted(t, seeds, "g", "orders")
	// The records ran on the consumer's lanes, still open: the processor's
	// stats count them.
	if st := p.Stats(); st.Applied != n || st.Duplicates != 0 {
		t.Errorf("processor stats while running %+v, want %d applied", st, n)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	eff.check(t, n)
	if st := c.Stats(); st.Final != n || st.Records != n {
		t.Errorf("stats %+v, want %d records all final", st, n)
	}
	// Run closed its lanes: their counts moved to the processor's, once.
	if st := p.Stats(); st.Applied != n || st.Duplicates != 0 {
		t.Errorf("processor stats after Close %+v, want %d applied", st, n)
	}
}

// A crash after the store's commit and before the offset commit: the next
// consumer gets the records again and finds them duplicates.
func TestCrashAfterStoreCommitBeforeOffsetCommit(t *testing.T) {
	_, seeds := cluster(t, 2, "orders")
	const n = 100
	produce(t, seeds, "orders", n, 8, nil)
	store, _ := memstore.New()
	defer store.Close()
	eff := newEffects()
	c1 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, nil))
	var asked atomic.Int32
	c1.cfg.crash = func(offs map[string]map[int32]kgo.EpochOffset) bool {
		asked.Add(1)
		return len(offs) > 0 // crash at the first commit of anything
	}
	if err := c1.Run(context.Background()); !errors.Is(err, errCrashed) {
		t.Fatalf("Run = %v, want the simulated crash", err)
	}
	applied := eff.distinct()
	if applied == 0 {
		t.Fatal("nothing applied before the crash")
	}
	if got := committed(t, seeds, "g", "orders"); len(got) != 0 {
		t.Fatalf("offsets committed by a crashed consumer: %v", got)
	}
	c2 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, nil))
	stop := run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	stop()
	eff.check(t, n)
	if d := c2.Stats().Duplicates; d != uint64(applied) {
		t.Errorf("second consumer saw %d duplicates, want the %d applied before the crash", d, applied)
	}
}

// A crash before the store's commit (the handler was running when the
// process went down): nothing past the unfinished record is committed,
// and the redelivery applies it once.
func TestCrashBeforeStoreCommit(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 50
	produce(t, seeds, "orders", n, 4, nil)
	store, _ := memstore.New()
	defer store.Close()
	eff := newEffects()
	entered := make(chan struct{})
	var once sync.Once
	block := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "m20" {
			once.Do(func() { close(entered) })
			<-ctx.Done() // the process dies mid-handler
			return nil, ctx.Err()
		}
		return nil, nil
	}
	c1 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, block))
	stop1 := run(t, c1)
	<-entered
	stop1()
	if got := committed(t, seeds, "g", "orders")[0]; got > 20 {
		t.Fatalf("committed offset %d is past the unfinished record at 20", got)
	}
	if eff.n["m20"] != 0 {
		t.Fatal("m20 took effect before the crash")
	}
	c2 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, nil))
	stop2 := run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	stop2()
	eff.check(t, n)
}

// Two consumers in one group, the second joining mid-run and the first
// leaving, with transient failures holding partitions when they are
// revoked: no record lost, none applied twice, and no commit ever past a
// record whose decision was not final (checked at every commit of both
// consumers).
func TestRebalanceMidRun(t *testing.T) { rebalanceMidRun(t) }

// TestRebalanceMidRunBatch is TestRebalanceMidRun in batch mode, where a
// partition's last batch completion of a poll is in flight while the
// loop polls again: a rebalance waits for it.
func TestRebalanceMidRunBatch(t *testing.T) { rebalanceMidRun(t, WithBatch(20)) }

func rebalanceMidRun(t *testing.T, opts ...ConsumerOption) {
	_, seeds := cluster(t, 6, "orders")
	const n = 3000
	produce(t, seeds, "orders", n, 64, nil)
	store, _ := memstore.New()
	defer store.Close()
	eff := newEffects()
	var seen atomic.Int64
	var mu sync.Mutex
	final := map[string]bool{} // "topic/partition/offset" decided for good
	fails := map[string]int{}
	flaky := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		seen.Add(1)
		i, _ := strconv.Atoi(m.ID[1:])
		mu.Lock()
		defer mu.Unlock()
		if i%50 == 0 && fails[m.ID] < 3 {
			fails[m.ID]++
			return nil, consumer.Transient(errors.New("busy"))
		}
		return nil, nil
	}
	observe := consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
		if d.Action != consumer.Retry {
			mu.Lock()
			final[m.Headers[HeaderKafkaSource]] = true
			mu.Unlock()
		}
	})
	var violations atomic.Int64
	var checked atomic.Int64
	check := func(offs map[string]map[int32]kgo.EpochOffset) bool {
		mu.Lock()
		defer mu.Unlock()
		for topic, ps := range offs {
			for p, o := range ps {
				checked.Add(1)
				for off := int64(0); off < o.Offset; off++ {
					if !final[fmt.Sprintf("%s/%d/%d", topic, p, off)] {
						violations.Add(1)
					}
				}
			}
		}
		return false // observe only
	}
	opts = append(opts, WithMaxPollRecords(50))
	c1 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, flaky, observe), opts...)
	c1.cfg.crash = check
	stop1 := run(t, c1)
	waitFor(t, "first records", func() bool { return seen.Load() > 200 })
	c2 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, flaky, observe), opts...)
	c2.cfg.crash = check
	stop2 := run(t, c2)
	waitFor(t, "the second consumer to get partitions", func() bool { return c2.Stats().Records > 0 })
	stop1()
	allCommitted(t, seeds, "g", "orders")
	stop2()
	eff.check(t, n)
	s1, s2 := c1.Stats(), c2.Stats()
	if s1.Revoked == 0 {
		t.Errorf("the first consumer saw no revocation: %+v", s1)
	}
	if violations.Load() != 0 || checked.Load() == 0 {
		t.Errorf("%d commits checked, %d offsets committed past a record not final", checked.Load(), violations.Load())
	}
	t.Logf("c1 %+v\nc2 %+v", s1, s2)
}

// A poison record goes to the dead-letter topic with its original IDs,
// key and headers while its partition goes on; a replay from the topic
// applies exactly what never completed.
func TestPoisonToDLQAndReplay(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 30
	produce(t, seeds, "orders", n, 3, func(i int, r *kgo.Record) {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: "trace", Value: []byte("t" + strconv.Itoa(i))})
	})
	dlq, err := NewDLQ(context.Background(), seeds, "orders.dlq")
	if err != nil {
		t.Fatal(err)
	}
	defer dlq.Close()
	store, _ := memstore.New()
	defer store.Close()
	eff := newEffects()
	var fixed atomic.Bool
	poison := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if (m.ID == "m7" || m.ID == "m8") && !fixed.Load() {
			return nil, consumer.Permanent(errors.New("cannot parse"))
		}
		return nil, nil
	}
	p := processor(t, store, eff, poison, consumer.WithDeadLetter(dlq))
	c := newConsumer(t, seeds, "g", "orders", p)
	stop := run(t, c)
	allCommitted(t, seeds, "g", "orders")
	stop()
	if eff.distinct() != n-2 {
		t.Fatalf("%d applied, want %d (all but the poison)", eff.distinct(), n-2)
	}
	ctx := context.Background()
	dls, err := dlq.List(ctx, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(dls) != 2 {
		t.Fatalf("%d dead letters, want 2", len(dls))
	}
	for _, dl := range dls {
		m := dl.Message
		i, _ := strconv.Atoi(m.ID[1:])
		if m.Subject != "orders" || m.Headers["trace"] != "t"+strconv.Itoa(i) || m.Headers[HeaderKafkaKey] != fmt.Sprintf("k%d", i%3) ||
			dl.Key != (dedup.Key{Scope: "kafka-test", ID: m.ID}) || dl.Class != consumer.ClassPermanent || string(m.Payload) != "v"+strconv.Itoa(i) {
			t.Errorf("dead letter %+v lost its original IDs, key or headers", dl)
		}
	}
	// Delete one by hand; the other is replayed through Kafka.
	if err := dlq.Delete(ctx, dls[0].ID); err != nil {
		t.Fatal(err)
	}
	if left, _ := dlq.List(ctx, "", 0); len(left) != 1 || left[0].ID != dls[1].ID {
		t.Fatalf("after delete: %+v", left)
	}
	fixed.Store(true)
	pub, err := NewPublisher(seeds)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	rep, err := consumer.Replay(ctx, dlq, pub, consumer.ReplayOptions{Store: store})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Replayed != 1 {
		t.Fatalf("replay report %+v, want 1 replayed", rep)
	}
	c2 := newConsumer(t, seeds, "g", "orders", processor(t, store, eff, poison))
	stop2 := run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	stop2()
	if eff.n[dls[1].Message.ID] != 1 || eff.n[dls[0].Message.ID] != 0 {
		t.Fatalf("after replay: %v", eff.n)
	}
	if left, _ := dlq.List(ctx, "", 0); len(left) != 0 {
		t.Fatalf("replayed record still listed: %+v", left)
	}
}

// Transient failures hold the partition: the record is retried before
// any later one, so each key's order is kept.
func TestRetryKeepsOrder(t *testing.T) {
	_, seeds := cluster(t, 2, "orders")
	const n, keys = 200, 5
	produce(t, seeds, "orders", n, keys, nil)
	eff := newEffects()
	var mu sync.Mutex
	fails := map[string]int{}
	flaky := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		mu.Lock()
		defer mu.Unlock()
		i, _ := strconv.Atoi(m.ID[1:])
		if i%17 == 0 && fails[m.ID] < 2 {
			fails[m.ID]++
			return nil, consumer.Transient(errors.New("busy"))
		}
		return nil, nil
	}
	c := newConsumer(t, seeds, "g", "orders", processor(t, nil, eff, flaky))
	stop := run(t, c)
	allCommitted(t, seeds, "g", "orders")
	stop()
	eff.check(t, n)
	if h := c.Stats().Held; h != uint64(2*len(fails)) {
		t.Errorf("held %d times, want %d", h, 2*len(fails))
	}
	for k, ids := range eff.order {
		if !slices.IsSortedFunc(ids, func(a, b string) int {
			x, _ := strconv.Atoi(a[1:])
			y, _ := strconv.Atoi(b[1:])
			return x - y
		}) {
			t.Errorf("key %s applied out of order: %v", k, ids)
		}
	}
}

// Bad arguments are refused before any I/O.
func TestNewConsumerArguments(t *testing.T) {
	p := processor(t, nil, newEffects(), nil)
	for _, tc := range []struct {
		brokers []string
		group   string
		topics  []string
		opts    []ConsumerOption
	}{
		{nil, "g", []string{"t"}, nil},
		{[]string{"x:1"}, "", []string{"t"}, nil},
		{[]string{"x:1"}, "g", nil, nil},
		{[]string{"x:1"}, "g", []string{"bad topic"}, nil},
		{[]string{"x:1"}, "g", []string{"t"}, []ConsumerOption{WithConcurrency(0)}},
		{[]string{"x:1"}, "g", []string{"t"}, []ConsumerOption{WithBatch(1000)}},
		{[]string{"x:1"}, "g", []string{"t"}, []ConsumerOption{WithLogger(nil)}},
	} {
		if _, err := NewConsumer(tc.brokers, tc.group, tc.topics, p, tc.opts...); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("NewConsumer(%v, %q, %v) = %v, want an invalid-argument error", tc.brokers, tc.group, tc.topics, err)
		}
	}
	if _, err := NewConsumer([]string{"x:1"}, "g", []string{"t"}, nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("nil processor: %v", err)
	}
}

// TestBatchUnreadableRecords: in batch mode, records whose envelope cannot
// be read (an unparseable version header) in the middle of a batch, and as
// a batch's first record, are dead-lettered in their turn, and every other
// record of their batches is applied once and decided in its own place:
// the processor's decisions (for the records it ran) are matched back to
// the batch's records past the ones it did not run.
func TestBatchUnreadableRecords(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 40
	bad := map[int]bool{3: true, 4: true, 10: true, 17: true, 39: true} // in batches of 10 from m0 (as one poll brings them): two mid-batch, a first, a last
	produce(t, seeds, "orders", n, 4, func(i int, r *kgo.Record) {
		if bad[i] {
			r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderVersion, Value: []byte("x")})
		}
	})
	eff := newEffects()
	dlq := &consumer.MemoryDLQ{}
	c := newConsumer(t, seeds, "g", "orders", processor(t, nil, eff, nil, consumer.WithDeadLetter(dlq)), WithBatch(10))
	stop := run(t, c)
	allCommitted(t, seeds, "g", "orders")
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	eff.mu.Lock()
	for i := range n {
		id := fmt.Sprintf("m%d", i)
		if want := map[bool]int{false: 1, true: 0}[bad[i]]; eff.n[id] != want {
			t.Errorf("%s took effect %d times, want %d", id, eff.n[id], want)
		}
	}
	eff.mu.Unlock()
	dls, err := dlq.List(context.Background(), "", 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, d := range dls {
		got = append(got, d.Message.ID)
	}
	if want := []string{"m3", "m4", "m10", "m17", "m39"}; !slices.Equal(got, want) {
		t.Errorf("dead letters %v, want %v", got, want)
	}
	if st := c.Stats(); st.Final != n || st.EnvelopeErrors != uint64(len(bad)) || st.DeadLettered != uint64(len(bad)) {
		t.Errorf("stats %+v, want %d final, %d envelope errors and dead letters", st, n, len(bad))
	}
}
