package dedupkafka

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// newHeldStore holds the completion of the first batch (the one from m0).
// The batch is picked by its first key, not by the order of the calls: the
// first batch's completion runs on a goroutine of the pipeline, and under
// load the second batch can be claimed, run and completed before that
// goroutine reaches the store.
func newHeldStore(t *testing.T) *redistest.Held {
	t.Helper()
	prefix := "kpipe:" + t.Name() + ":" + strconv.FormatInt(time.Now().UnixNano(), 36) + ":"
	return redistest.NewHeld(t, prefix, func(items []dedup.Completion) bool {
		return len(items) > 0 && items[0].Claim.Key.ID == "m0"
	})
}

// TestBatchPipelineCompletionLostHoldsPartition: in batch mode on Redis,
// the second batch of a partition is claimed while the first batch's
// completion is held, and nothing of the partition is final or committed
// before that completion returns. The completion finds one record's lease
// lost (its record deleted meanwhile): that record is not final, the
// partition holds at it, no offset past it is committed until it was
// run again, and every record ends applied (the lost one twice: its
// record was gone) and committed.
func TestBatchPipelineCompletionLostHoldsPartition(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 250
	produce(t, seeds, "orders", n, 7, nil)
	eff := newEffects()
	store := newHeldStore(t)
	p, err := consumer.New("kafka-pipe", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	var (
		mu   sync.Mutex
		past int64 // the highest offset committed before m50 was applied again
	)
	c.cfg.crash = func(offs map[string]map[int32]kgo.EpochOffset) bool {
		eff.mu.Lock()
		again := eff.n["m50"] >= 2
		eff.mu.Unlock()
		mu.Lock()
		defer mu.Unlock()
		if o, ok := offs["orders"][0]; ok && !again && o.Offset > past {
			past = o.Offset
		}
		return false
	}
	stop := run(t, c)
	t.Cleanup(store.Open)

	items := <-store.Entered
	if len(items) != 100 || items[0].Claim.Key.ID != "m0" {
		t.Fatalf("first completion of %d items from %s, want m0..m99", len(items), items[0].Claim.Key.ID)
	}
	// The next batch is claimed while this completion is held.
	waitFor(t, "the second batch claimed under the held completion", func() bool { return store.Claims.Load() >= 2 })
	if s := c.Stats(); s.Final != 0 || s.Commits != 0 {
		t.Fatalf("stats %+v while the first completion is held: want nothing final or committed", s)
	}
	if got := committed(t, seeds, "g", "orders"); len(got) != 0 {
		t.Fatalf("committed %v while the first completion is held", got)
	}
	rc := store.Client()
	if err := rc.Do(context.Background(), rc.B().Del().Key(store.RedisKey(items[50].Claim.Key)).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	store.Open()
	allCommitted(t, seeds, "g", "orders")
	stop()

	mu.Lock()
	if past > 50 {
		t.Errorf("offset %d committed before m50 (offset 50), whose completion failed, was run again", past)
	}
	mu.Unlock()
	eff.mu.Lock()
	for i := range n {
		id := "m" + strconv.Itoa(i)
		want := 1
		if i == 50 {
			want = 2
		}
		if eff.n[id] != want {
			t.Errorf("%s took effect %d times, want %d", id, eff.n[id], want)
		}
	}
	eff.mu.Unlock()
	if s := c.Stats(); s.Held == 0 || s.Duplicates < 149 {
		t.Errorf("stats %+v: want the partition held and m51..m199 found duplicate when run again", s)
	}
}

// TestBatchPipelineHeldCompletionFailureStopsLaterBatches: only the batch
// right after one whose completion fails may have run (WithBatch's
// promise). With batches m0..m99, m100..m199, m200..m299 in one poll, the
// first batch's completion is held while the second is claimed and run;
// the third is built then and waits for a pipeline slot. The held
// completion finds m50's lease lost: the partition holds at m50, and no
// record of the third batch may run before m50 ran again (it used to: the
// drain checked for a hold before it waited for the slot, which the first
// batch frees only after its decisions, so the third batch was claimed and
// run right after the partition was held).
func TestBatchPipelineHeldCompletionFailureStopsLaterBatches(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 300
	produce(t, seeds, "orders", n, 7, nil)
	store := newHeldStore(t)
	var (
		mu    sync.Mutex
		runs  = map[int]int{}
		early []int // records of the third batch run before m50 ran again
	)
	p, err := consumer.New("kafka-pipe", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		i, err := strconv.Atoi(m.ID[1:])
		if err != nil {
			return nil, err
		}
		mu.Lock()
		defer mu.Unlock()
		runs[i]++
		if i >= 200 && runs[50] < 2 {
			early = append(early, i)
		}
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	stop := run(t, c)
	t.Cleanup(store.Open)

	items := <-store.Entered
	if len(items) != 100 || items[0].Claim.Key.ID != "m0" {
		t.Fatalf("first completion of %d items from %s, want m0..m99", len(items), items[0].Claim.Key.ID)
	}
	waitFor(t, "the second batch claimed under the held completion", func() bool { return store.Claims.Load() >= 2 })
	time.Sleep(50 * time.Millisecond) // the third batch built and waiting for a slot
	rc := store.Client()
	if err := rc.Do(context.Background(), rc.B().Del().Key(store.RedisKey(items[50].Claim.Key)).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	store.Open()
	allCommitted(t, seeds, "g", "orders")
	stop()

	mu.Lock()
	defer mu.Unlock()
	if len(early) > 0 {
		t.Errorf("%d records of the third batch (m%d...) ran before m50, held after its completion failed, ran again", len(early), early[0])
	}
	for i := range n {
		want := 1
		if i == 50 {
			want = 2
		}
		if runs[i] != want {
			t.Errorf("m%d ran %d times, want %d", i, runs[i], want)
		}
	}
}

// TestBatchPipelineCloseWaitsForCompletionInFlight: Close while a batch's
// completion is held (and the next batch of the partition was claimed and
// run under it) waits for it; nothing is committed before it returned; a
// new consumer of the group then finds every record applied once and
// commits to the end: nothing lost, nothing applied twice. It failed when
// the batch completion ran on the batch's context, which Close cancels:
// cut short, it left m0..m99 in progress, nothing was committed, and the
// new consumer took them over after the lease and applied them again.
func TestBatchPipelineCloseWaitsForCompletionInFlight(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 250
	produce(t, seeds, "orders", n, 7, nil)
	eff := newEffects()
	store := newHeldStore(t)
	p, err := consumer.New("kafka-pipe-close", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	stop := run(t, c)
	t.Cleanup(store.Open)

	<-store.Entered
	waitFor(t, "the second batch claimed under the held completion", func() bool { return store.Claims.Load() >= 2 })
	closed := make(chan error, 1)
	go func() { closed <- stop() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a batch's completion was in flight")
	case <-time.After(300 * time.Millisecond):
	}
	if got := committed(t, seeds, "g", "orders"); len(got) != 0 {
		t.Fatalf("committed %v while the first completion is held", got)
	}
	store.Open()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Close did not return after the completion")
	}
	if got := committed(t, seeds, "g", "orders"); got[0] < 100 {
		t.Errorf("committed %v after Close: want at least the held batch's 100 records", got)
	}

	c2 := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	eff.check(t, n)
}

// heldOne holds the first Complete of record m0 (one record at a time:
// the processor completes each record alone) until release is closed.
type heldOne struct {
	*redistest.Held
	calls   atomic.Int64
	one     sync.Once
	entered chan struct{}
}

func (s *heldOne) Complete(ctx context.Context, c dedup.Claim, result []byte, ret time.Duration) error {
	if c.Key.ID == "m0" && s.calls.Add(1) == 1 {
		s.one.Do(func() { close(s.entered) })
		<-s.Released()
	}
	return s.Held.Store.Complete(ctx, c, result, ret)
}

// TestCloseWaitsForRecordCompletionInFlight: one record at a time (the
// default), Close while a record's Complete is in flight lets it land:
// the record is final and committed, and a new consumer of the group
// applies nothing twice. It failed when records ran on Run's context,
// which Close cancels: the cut-short completion left m0 in progress and
// uncommitted, and the next consumer took it over after the lease and
// applied it again.
func TestCloseWaitsForRecordCompletionInFlight(t *testing.T) {
	_, seeds := cluster(t, 1, "orders")
	const n = 20
	produce(t, seeds, "orders", n, 7, nil)
	eff := newEffects()
	store := &heldOne{Held: newHeldStore(t), entered: make(chan struct{})}
	p, err := consumer.New("kafka-close-one", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(2*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, seeds, "g", "orders", p)
	stop := run(t, c)
	t.Cleanup(store.Open)

	<-store.entered
	closed := make(chan error, 1)
	go func() { closed <- stop() }()
	select {
	case <-closed:
		t.Fatal("Close returned while a record's completion was in flight")
	case <-time.After(200 * time.Millisecond):
	}
	store.Open()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(time.Minute):
		t.Fatal("Close did not return after the completion")
	}
	if got := committed(t, seeds, "g", "orders"); got[0] < 1 {
		t.Errorf("committed %v after Close: want m0 committed", got)
	}
	c2 := newConsumer(t, seeds, "g", "orders", p)
	run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	eff.check(t, n)
}

// produceTo writes n records with IDs m<from>..m<from+n-1> (key "k<i>")
// to partition part of topic.
func produceTo(t *testing.T, seeds []string, topic string, part int32, from, n int) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.RecordPartitioner(kgo.ManualPartitioner()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rs := make([]*kgo.Record, n)
	for i := range n {
		id := "m" + strconv.Itoa(from+i)
		rs[i] = &kgo.Record{Topic: topic, Partition: part, Key: []byte("k" + strconv.Itoa(from+i)), Value: []byte(id),
			Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: []byte(id)}}}
	}
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// commitWatch checks every offset commit the cluster receives (the
// loop's, and the revocation's on a rebalance) against the records whose
// decision was final when it arrived: an offset committed past a record
// not final is a violation.
type commitWatch struct {
	mu         sync.Mutex
	final      map[string]bool // "partition/offset" decided for good (one topic; a request may name it by ID)
	commits    int
	violations []string
}

func watchCommits(c *kfake.Cluster) *commitWatch {
	w := &commitWatch{final: map[string]bool{}}
	c.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		w.mu.Lock()
		defer w.mu.Unlock()
		for _, tp := range req.(*kmsg.OffsetCommitRequest).Topics {
			for _, p := range tp.Partitions {
				w.commits++
				for off := int64(0); off < p.Offset; off++ {
					if k := strconv.Itoa(int(p.Partition)) + "/" + strconv.FormatInt(off, 10); !w.final[k] {
						w.violations = append(w.violations, "offset "+strconv.FormatInt(p.Offset, 10)+" committed past "+k)
						break
					}
				}
			}
		}
		return nil, nil, false // observe only
	})
	return w
}

// observer marks each record whose decision is final.
func (w *commitWatch) observer() consumer.Option {
	return consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
		if d.Action != consumer.Retry {
			w.mu.Lock()
			src := m.Headers[HeaderKafkaSource] // topic/partition/offset
			w.final[src[strings.IndexByte(src, '/')+1:]] = true
			w.mu.Unlock()
		}
	})
}

func (w *commitWatch) check(t *testing.T) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.commits == 0 {
		t.Error("no offset commit seen")
	}
	for _, v := range w.violations {
		t.Error(v)
	}
}

// TestBatchCompletionInFlightAcrossPolls: in batch mode the last batch of
// a poll leaves its completion in flight while the loop polls again and
// the partition's next batch (from the next poll) is claimed and run
// under it (before, the round waited for it, so the next poll's batch was
// claimed only after it). Nothing of the partition is final or committed
// while it is held; the completion then finds one record's lease lost
// (its record deleted meanwhile): no offset is ever committed past that
// record before it ran again (every commit the cluster receives is
// checked), and every record ends applied and committed (the lost one
// twice: its record was gone).
func TestBatchCompletionInFlightAcrossPolls(t *testing.T) {
	kc, seeds := cluster(t, 1, "orders")
	const n = 300
	produceTo(t, seeds, "orders", 0, 0, n)
	watch := watchCommits(kc)
	eff := newEffects()
	store := newHeldStore(t)
	p, err := consumer.New("kafka-pipe-polls", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}), watch.observer())
	if err != nil {
		t.Fatal(err)
	}
	// A poll of at most 100 records is one batch: the held batch is the
	// last (the only) one of its poll.
	c := newConsumer(t, seeds, "g", "orders", p, WithBatch(100), WithMaxPollRecords(100))
	stop := run(t, c)
	t.Cleanup(store.Open)

	items := <-store.Entered
	if items[0].Claim.Key.ID != "m0" {
		t.Fatalf("held completion from %s, want m0", items[0].Claim.Key.ID)
	}
	waitFor(t, "the next poll's batch claimed under the held completion", func() bool { return store.Claims.Load() >= 2 })
	if s := c.Stats(); s.Final != 0 || s.Commits != 0 || s.Records <= uint64(len(items)) {
		t.Fatalf("stats %+v while the first completion is held: want a second poll, nothing final or committed", s)
	}
	if got := committed(t, seeds, "g", "orders"); len(got) != 0 {
		t.Fatalf("committed %v while the first completion is held", got)
	}
	lost := items[len(items)/2].Claim.Key
	rc := store.Client()
	if err := rc.Do(context.Background(), rc.B().Del().Key(store.RedisKey(lost)).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	store.Open()
	allCommitted(t, seeds, "g", "orders")
	stop()

	watch.check(t)
	eff.mu.Lock()
	for i := range n {
		id := "m" + strconv.Itoa(i)
		want := 1
		if id == lost.ID {
			want = 2
		}
		if eff.n[id] != want {
			t.Errorf("%s took effect %d times, want %d", id, eff.n[id], want)
		}
	}
	eff.mu.Unlock()
	if s := c.Stats(); s.Held == 0 {
		t.Errorf("stats %+v: want the partition held at %s", s, lost.ID)
	}
}

// TestBatchRebalanceWhileCompletionInFlight: a rebalance that comes while
// a partition's last batch completion is in flight (the loop polling for
// more) waits for it, and commits nothing that is not final: with that
// completion held, a second consumer joins the group; nothing of the
// held partition is committed while it is held; the completion then
// finds one record's lease lost, so the partition's first records are
// final and the rest are not. Every commit the cluster receives (the
// loop's and the revocation's) stays at or below the lost record until
// it ran again, and every record ends applied (the lost one twice) and
// committed by the two consumers.
func TestBatchRebalanceWhileCompletionInFlight(t *testing.T) {
	kc, seeds := cluster(t, 2, "orders")
	const per = 100
	produceTo(t, seeds, "orders", 0, 0, per)
	produceTo(t, seeds, "orders", 1, per, per)
	watch := watchCommits(kc)
	eff := newEffects()
	store := newHeldStore(t)
	p, err := consumer.New("kafka-pipe-rebalance", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}), watch.observer())
	if err != nil {
		t.Fatal(err)
	}
	c1 := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	stop1 := run(t, c1)
	t.Cleanup(store.Open)

	items := <-store.Entered
	if items[0].Claim.Key.ID != "m0" {
		t.Fatalf("held completion from %s, want m0", items[0].Claim.Key.ID)
	}
	waitFor(t, "partition 1 committed", func() bool { return committed(t, seeds, "g", "orders")[1] == per })
	c2 := newConsumer(t, seeds, "g", "orders", p, WithBatch(100))
	stop2 := run(t, c2)
	time.Sleep(300 * time.Millisecond) // the rebalance waits for the held completion
	if got, ok := committed(t, seeds, "g", "orders")[0]; ok {
		t.Fatalf("partition 0 committed at %d while its completion is held", got)
	}
	if s := c2.Stats(); s.Records != 0 {
		t.Fatalf("the second consumer got records while the first one's completion was held: %+v", s)
	}
	lost := items[len(items)/2].Claim.Key
	rc := store.Client()
	if err := rc.Do(context.Background(), rc.B().Del().Key(store.RedisKey(lost)).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	store.Open()
	waitFor(t, "the rebalance", func() bool { s := c1.Stats(); return s.Revoked > 0 })
	allCommitted(t, seeds, "g", "orders")
	stop1()
	stop2()

	watch.check(t)
	eff.mu.Lock()
	for i := range 2 * per {
		id := "m" + strconv.Itoa(i)
		want := 1
		if id == lost.ID {
			want = 2
		}
		if eff.n[id] != want {
			t.Errorf("%s took effect %d times, want %d", id, eff.n[id], want)
		}
	}
	eff.mu.Unlock()
}
