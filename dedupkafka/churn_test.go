package dedupkafka

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// slowComplete is a memstore whose batch completions take a little while,
// so that a partition's last batch completion of a poll is still in flight
// while the loop polls again, takes decisions as they arrive (nil-context
// polls) and rebalances happen.
type slowComplete struct {
	*memstore.Store
	max time.Duration
}

func (s *slowComplete) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	time.Sleep(time.Duration(rand.Int64N(int64(s.max))))
	return s.Store.CompleteBatch(ctx, items, retention)
}

// TestBatchChurnCompletionsInFlight: batch mode, completions in
// flight across polls, transient handler failures holding partitions,
// and consumers joining and leaving the group several times (so that
// revocations come while completions are in flight, including through an
// empty poll that leaves rebalances unblocked). Every OffsetCommit the
// cluster receives must stay at or below the first record not final, and
// every record takes effect exactly once and ends committed.
func TestBatchChurnCompletionsInFlight(t *testing.T) {
	kc, seeds := cluster(t, 4, "orders")
	const n = 2000
	produce(t, seeds, "orders", n, 64, nil)
	watch := watchCommits(kc)
	var regmu sync.Mutex
	last := map[int32]int64{}
	regressions := 0
	kc.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		regmu.Lock()
		defer regmu.Unlock()
		for _, tp := range req.(*kmsg.OffsetCommitRequest).Topics {
			for _, p := range tp.Partitions {
				if p.Offset < last[p.Partition] {
					regressions++
				}
				last[p.Partition] = p.Offset
			}
		}
		return nil, nil, false
	})
	ms, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	store := &slowComplete{Store: ms, max: 4 * time.Millisecond}
	eff := newEffects()
	var fmu sync.Mutex
	fails := map[string]int{}
	p, err := consumer.New("kafka-attack", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		i, _ := strconv.Atoi(m.ID[1:])
		fmu.Lock()
		if i%37 == 0 && fails[m.ID] < 2 {
			fails[m.ID]++
			fmu.Unlock()
			return nil, consumer.Transient(errors.New("busy"))
		}
		fmu.Unlock()
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 5*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}), watch.observer())
	if err != nil {
		t.Fatal(err)
	}
	opts := []ConsumerOption{WithBatch(7), WithMaxPollRecords(20)}
	c1 := newConsumer(t, seeds, "g", "orders", p, opts...)
	stop1 := run(t, c1)
	waitFor(t, "first records final", func() bool { return c1.Stats().Final > 100 })
	for round := range 3 {
		c2 := newConsumer(t, seeds, "g", "orders", p, opts...)
		stop2 := run(t, c2)
		waitFor(t, "c2 records "+strconv.Itoa(round), func() bool { return c2.Stats().Final > 20 })
		stop2()
	}
	allCommitted(t, seeds, "g", "orders")
	stop1()
	watch.check(t)
	eff.check(t, n)
	regmu.Lock()
	t.Logf("commit regressions seen: %d; c1 %+v", regressions, c1.Stats())
	regmu.Unlock()
}

// lossyComplete is a memstore whose batch completions are slow and now
// and then find one item's record gone (released just before the
// completion, as a lost lease): that record's handler ran, its completion
// fails, and it runs again (one more effect) when it is redelivered.
type lossyComplete struct {
	*memstore.Store
	max      time.Duration
	mu       sync.Mutex
	injected map[string]int
	calls    int
}

func (s *lossyComplete) CompleteBatch(ctx context.Context, items []dedup.Completion, retention time.Duration) ([]error, error) {
	time.Sleep(time.Duration(rand.Int64N(int64(s.max))))
	s.mu.Lock()
	s.calls++
	if s.calls%5 == 0 && len(items) > 0 {
		it := items[rand.IntN(len(items))]
		if s.injected[it.Claim.Key.ID] < 2 {
			if err := s.Store.Release(ctx, it.Claim); err == nil {
				s.injected[it.Claim.Key.ID]++
			}
		}
	}
	s.mu.Unlock()
	return s.Store.CompleteBatch(ctx, items, retention)
}

// TestBatchLostCompletionsAcrossPollsChurn: completions in flight
// across polls now and then find a record's lease lost (so the partition
// holds at it while the next poll's batch was already claimed and run),
// with consumers joining and leaving the group. No OffsetCommit may pass
// a record not final, and each record takes effect once plus once per
// lost completion, and ends committed.
func TestBatchLostCompletionsAcrossPollsChurn(t *testing.T) {
	kc, seeds := cluster(t, 4, "orders")
	const n = 2000
	produce(t, seeds, "orders", n, 64, nil)
	watch := watchCommits(kc)
	ms, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	store := &lossyComplete{Store: ms, max: 3 * time.Millisecond, injected: map[string]int{}}
	eff := newEffects()
	p, err := consumer.New("kafka-attack-lossy", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.apply(m)
		return nil, nil
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 5*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}), watch.observer())
	if err != nil {
		t.Fatal(err)
	}
	opts := []ConsumerOption{WithBatch(7), WithMaxPollRecords(20)}
	c1 := newConsumer(t, seeds, "g", "orders", p, opts...)
	stop1 := run(t, c1)
	waitFor(t, "first records final", func() bool { return c1.Stats().Final > 100 })
	for round := range 3 {
		c2 := newConsumer(t, seeds, "g", "orders", p, opts...)
		stop2 := run(t, c2)
		waitFor(t, "c2 records "+strconv.Itoa(round), func() bool { return c2.Stats().Final > 20 })
		stop2()
	}
	allCommitted(t, seeds, "g", "orders")
	stop1()
	watch.check(t)
	eff.mu.Lock()
	store.mu.Lock()
	lost := 0
	for i := range n {
		id := "m" + strconv.Itoa(i)
		want := 1 + store.injected[id]
		lost += store.injected[id]
		if eff.n[id] != want {
			t.Errorf("%s took effect %d times, want %d (lost completions %d)", id, eff.n[id], want, store.injected[id])
		}
	}
	store.mu.Unlock()
	eff.mu.Unlock()
	t.Logf("lost completions %d; c1 %+v", lost, c1.Stats())
}

// closeDuringHandler: Close while m0's handler is running (its remote call
// made, its response awaited). Run promises that the records being
// processed run on a context that outlives Close by the drain timeout (an
// hour here), so the handler's response arrives, its record completes
// and nothing is applied twice. A handler cut short by Close returns its
// context's error (an unclassified, retryable failure: the claim is
// released) and the next consumer applies m0 again.
func closeDuringHandler(t *testing.T, opts ...ConsumerOption) {
	_, seeds := cluster(t, 1, "orders")
	const n = 20
	produce(t, seeds, "orders", n, 7, nil)
	eff := newEffects()
	entered, respond := make(chan struct{}), make(chan struct{})
	var once sync.Once
	var cut sync.Once
	cutShort := false
	ms, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer ms.Close()
	p, err := consumer.New("kafka-close-handler", ms, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		first := false
		if m.ID == "m0" {
			once.Do(func() { first = true })
		}
		if !first {
			eff.apply(m)
			return nil, nil
		}
		// The remote call: the remote applies it (one effect), then the
		// response comes back once respond is closed.
		eff.apply(m)
		close(entered)
		select {
		case <-respond:
			return nil, nil
		case <-ctx.Done():
			cut.Do(func() { cutShort = true })
			return nil, ctx.Err()
		}
	}, consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 5*time.Millisecond),
		consumer.WithLease(5*time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	c := newConsumer(t, seeds, "g", "orders", p, append([]ConsumerOption{WithDrainTimeout(time.Hour)}, opts...)...)
	stop := run(t, c)
	<-entered
	closed := make(chan error, 1)
	go func() { closed <- stop() }()
	select {
	case <-closed:
		t.Error("Close returned while a handler was running")
		close(respond)
	case <-time.After(300 * time.Millisecond):
		close(respond)
		<-closed
	}
	c2 := newConsumer(t, seeds, "g", "orders", p, opts...)
	run(t, c2)
	allCommitted(t, seeds, "g", "orders")
	if cutShort {
		t.Error("m0's handler context was cancelled by Close, within the drain timeout")
	}
	eff.mu.Lock()
	if eff.n["m0"] != 1 {
		t.Errorf("m0 took effect %d times, want 1", eff.n["m0"])
	}
	eff.mu.Unlock()
}

func TestCloseDuringHandlerRecordMode(t *testing.T) { closeDuringHandler(t) }

func TestCloseDuringHandlerBatchMode(t *testing.T) { closeDuringHandler(t, WithBatch(5)) }
