package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
)

// TestPipelinesShareRunnerMemory: several pipelines of one processor (a
// Kafka consumer's partitions) on Redis release their batches' memory to
// the one runner and recycle their decisions, with batches of random
// sizes (so that a large batch's memory goes to a small one and the other
// way), a heartbeat beating throughout, failures, repeated keys and keys
// shared between pipelines (found in progress in one of them): every
// decision is its own message's, under its key, and an Ack of a fresh
// run carries that message's own result, never one of another batch.
func TestPipelinesShareRunnerMemory(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := redistest.Store(t, uniquePrefix(t))
	p, err := consumer.New("pipe-shared", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if d.Key.ID != m.ID {
			return nil, fmt.Errorf("message %s ran under key %s", m.ID, d.Key.ID)
		}
		switch m.ID[:2] {
		case "tr":
			return nil, consumer.Transient(errors.New("later"))
		case "rj":
			return nil, consumer.Reject(errors.New("no"), []byte("rj:"+m.ID))
		}
		return []byte("r:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithLease(time.Minute), consumer.WithHeartbeat(time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	const pipelines, batches = 4, 40
	var (
		mu  sync.Mutex
		bad []string
		wg  sync.WaitGroup
	)
	for w := range pipelines {
		wg.Go(func() {
			pl := p.NewPipeline(2)
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for b := range batches {
				n := 1 + rng.IntN(80)
				if rng.IntN(3) == 0 {
					n = 1 + rng.IntN(4)
				}
				ms := make([]*consumer.Message, n)
				for i := range ms {
					id := "ok-" + strconv.Itoa(w) + "-" + strconv.Itoa(b) + "-" + strconv.Itoa(i)
					switch r := rng.IntN(10); {
					case r == 0:
						id = "tr" + id[2:]
					case r == 1:
						id = "rj" + id[2:]
					case r == 2 && i > 0:
						id = ms[i-1].ID // repeated inside the batch
					case r == 3:
						id = "ok-shared-" + strconv.Itoa(rng.IntN(50)) // other pipelines' too
					}
					ms[i] = msg(id)
				}
				pl.Submit(ctx, ms, func(ds []consumer.Decision) {
					defer pl.Recycle(ds)
					fail := func(f string, a ...any) {
						mu.Lock()
						bad = append(bad, fmt.Sprintf("pipeline %d batch %d: ", w, b)+fmt.Sprintf(f, a...))
						mu.Unlock()
					}
					if len(ds) != len(ms) {
						fail("%d decisions for %d messages", len(ds), len(ms))
						return
					}
					for i, m := range ms {
						d := ds[i]
						if d.Key.ID != m.ID {
							fail("message %d (%s) decided under key %q: %+v", i, m.ID, d.Key.ID, d)
							continue
						}
						switch {
						case d.Action == consumer.Ack && m.ID[:2] == "ok" && string(d.Result) != "r:"+m.ID:
							fail("%s acked with result %q", m.ID, d.Result)
						case d.Action == consumer.Rejected && string(d.Result) != "rj:"+m.ID:
							fail("%s rejected with result %q", m.ID, d.Result)
						case d.Action == consumer.Ack && m.ID[:2] == "rj" && (!d.Duplicate || string(d.Result) != "rj:"+m.ID):
							fail("%s acked: %+v", m.ID, d) // only a repeat of a rejection, with its result
						case d.Action == consumer.Ack && m.ID[:2] == "tr":
							fail("%s acked: %+v", m.ID, d)
						case d.Action == consumer.Retry && m.ID[:2] == "ok" && d.Err == nil:
							fail("%s retried without an error", m.ID)
						}
					}
				})
			}
			pl.Wait()
		})
	}
	wg.Wait()
	for _, b := range bad {
		t.Error(b)
	}
}
