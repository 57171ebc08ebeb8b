package dedupkafka

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
	"github.com/twmb/franz-go/pkg/kgo"
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
