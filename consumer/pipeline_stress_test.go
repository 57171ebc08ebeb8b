package consumer_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
	"github.com/dedupkit/dedup/redisstore"
)

// faulty is a real redisstore whose completions are slow and fail at
// random: before the write (nothing written) or after it (an unknown
// outcome that did write). It records which keys a call reported
// completed (nil) and which were written at all.
type faulty struct {
	batchStore
	mu      sync.Mutex
	rnd     *rand.Rand
	ok      map[string]bool // a completion of the key returned nil
	written map[string]bool // a completion of the key was written
}

func (f *faulty) roll() (before, after bool, pause time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	x := f.rnd.IntN(100)
	return x < 8, x >= 8 && x < 12, time.Duration(f.rnd.IntN(3000)) * time.Microsecond
}

var errInjected = errors.New("injected")

// batchStore is a store with batch calls and extensions.
type batchStore interface {
	dedup.Store
	dedup.Extender
	dedup.BatchClaimer
	dedup.BatchCompleter
}

func (f *faulty) note(id string, ok bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.written[id] = true
	if ok {
		f.ok[id] = true
	}
}

func (f *faulty) Complete(ctx context.Context, c dedup.Claim, result []byte, ret time.Duration) error {
	before, after, pause := f.roll()
	time.Sleep(pause)
	if before {
		return &dedup.StoreError{Store: "faulty", Op: "complete", Err: errInjected}
	}
	if err := f.batchStore.Complete(ctx, c, result, ret); err != nil {
		return err
	}
	f.note(c.Key.ID, !after)
	if after {
		return &dedup.StoreError{Store: "faulty", Op: "complete", Err: errInjected}
	}
	return nil
}

func (f *faulty) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	before, after, pause := f.roll()
	time.Sleep(pause)
	if before {
		return nil, &dedup.StoreError{Store: "faulty", Op: "complete batch", Err: errInjected}
	}
	errs, err := f.batchStore.CompleteBatch(ctx, items, ret)
	if err != nil {
		return errs, err
	}
	for k, it := range items {
		if errs[k] == nil {
			f.note(it.Claim.Key.ID, !after)
		}
	}
	if after {
		return nil, &dedup.StoreError{Store: "faulty", Op: "complete batch", Err: errInjected}
	}
	return errs, nil
}

// TestPipelineStressFaults runs random batches through a pipeline on
// Redis with slow completions that fail at random (before or after the
// write), handlers that fail or panic at random, and messages redelivered
// while their batch is in flight. It checks that handlers never run at
// once, that done is called in submission order, that an Ack of an
// applied message comes only after a completion of its key returned nil,
// that a duplicate's record was written, and that every message ends
// acknowledged or dead-lettered.
func TestPipelineStressFaults(t *testing.T) {
	t.Parallel()
	for _, depth := range []int{2, 3} {
		t.Run("depth"+strconv.Itoa(depth), func(t *testing.T) { stressPipeline(t, redisStress(t), depth, false) })
		t.Run("depth"+strconv.Itoa(depth)+"-shutdown", func(t *testing.T) { stressPipeline(t, redisStress(t), depth, true) })
	}
	t.Run("pgstore", func(t *testing.T) {
		s, _ := openApply(t)
		stressPipeline(t, s, 2, false)
	})
	t.Run("pgstore-shutdown", func(t *testing.T) {
		s, _ := openApply(t)
		stressPipeline(t, s, 2, true)
	})
}

func redisStress(t *testing.T) *redisstore.Store {
	t.Helper()
	prefix := uniquePrefix(t)
	s := redistest.Store(t, prefix)
	return s
}

// stressPipeline runs the stress; with shutdown, the context of the
// batches is cancelled at a random moment and no batch is submitted after
// it: the batches in flight are still decided, none with an Ack of a
// message not completed.
func stressPipeline(t *testing.T, s batchStore, depth int, shutdown bool) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	f := &faulty{batchStore: s, rnd: rand.New(rand.NewPCG(seed, 1)), ok: map[string]bool{}, written: map[string]bool{}}
	hr := rand.New(rand.NewPCG(seed, 2))
	var (
		running  atomic.Int32
		overlaps atomic.Int32
		hmu      sync.Mutex
	)
	p, err := consumer.New("pipe-stress", f, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if running.Add(1) != 1 {
			overlaps.Add(1)
		}
		defer running.Add(-1)
		hmu.Lock()
		x := hr.IntN(100)
		hmu.Unlock()
		time.Sleep(time.Duration(x%5) * 100 * time.Microsecond)
		switch {
		case x < 8:
			return nil, consumer.Transient(errInjected)
		case x < 10:
			panic("injected panic")
		}
		return []byte("r-" + m.ID), nil
	}, consumer.WithLogger(nil), consumer.WithLease(300*time.Millisecond), consumer.WithBackoff(time.Millisecond, 5*time.Millisecond),
		consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(depth)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dr := rand.New(rand.NewPCG(seed, 3))
	if shutdown {
		time.AfterFunc(time.Duration(50+dr.IntN(200))*time.Millisecond, cancel)
	}

	const n = 120
	var (
		mu       sync.Mutex
		queue    []*consumer.Message
		final    = map[string]consumer.Action{}
		bad      []string
		decided  int // batches decided
		inFlight = map[string]int{}
	)
	for i := range n {
		queue = append(queue, &consumer.Message{ID: "m" + strconv.Itoa(i), Delivery: 1})
	}
	deadline := time.Now().Add(40 * time.Second)
	for submitted := 0; ; {
		mu.Lock()
		done := len(final) == n && len(queue) == 0 || ctx.Err() != nil && submitted > 0
		if time.Now().After(deadline) {
			mu.Unlock()
			t.Fatalf("not done after 40s: %d final of %d, %d queued", len(final), n, len(queue))
		}
		k := min(1+dr.IntN(6), len(queue))
		batch := append([]*consumer.Message(nil), queue[:k]...)
		queue = queue[k:]
		// A redelivery of a message of this batch right behind it.
		if k > 0 && dr.IntN(100) < 15 {
			m := batch[dr.IntN(k)]
			queue = append([]*consumer.Message{{ID: m.ID, Delivery: m.Delivery + 1}}, queue...)
		}
		mu.Unlock()
		if done {
			break
		}
		mu.Lock()
		for _, m := range batch {
			inFlight[m.ID]++
		}
		mu.Unlock()
		if k == 0 {
			pl.Wait()
			time.Sleep(20 * time.Millisecond)
			continue
		}
		seq := submitted
		submitted++
		pl.Submit(ctx, batch, func(ds []consumer.Decision) {
			mu.Lock()
			defer mu.Unlock()
			if decided != seq {
				bad = append(bad, "batch "+strconv.Itoa(seq)+" decided after "+strconv.Itoa(decided)+" batches")
			}
			decided = seq + 1
			f.mu.Lock()
			defer f.mu.Unlock()
			for i, d := range ds {
				m := batch[i]
				inFlight[m.ID]--
				switch {
				case d.Action == consumer.Ack && !d.Duplicate && !f.ok[m.ID]:
					bad = append(bad, m.ID+" acked as applied before a completion of it returned nil")
				case d.Action == consumer.Ack && d.Duplicate && !f.written[m.ID]:
					bad = append(bad, m.ID+" acked as a duplicate with no completion written")
				}
				switch d.Action {
				case consumer.Retry:
					if _, ok := final[m.ID]; !ok {
						queue = append(queue, &consumer.Message{ID: m.ID, Delivery: m.Delivery + 1})
					}
				default:
					final[m.ID] = d.Action
				}
			}
		})
	}
	pl.Wait()
	mu.Lock()
	defer mu.Unlock()
	for _, b := range bad {
		t.Error(b)
	}
	if o := overlaps.Load(); o > 0 {
		t.Errorf("handlers ran at once %d times", o)
	}
	for id, c := range inFlight {
		if c != 0 {
			t.Errorf("%s: %d deliveries not decided", id, c)
		}
	}
}
