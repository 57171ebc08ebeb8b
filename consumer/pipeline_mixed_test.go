package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
)

// TestPipelineMixedBatchesInReusedMemory: batches of every size (growing
// and shrinking, so that reused memory is both too small and larger than
// needed) mixing successes, failures of each class, panics, rejections,
// keys repeated inside the batch (done alone, a barrier), messages
// without a valid key and nil messages, three in flight on Redis: each
// done gets, for each of its own messages, the decision its handler's
// outcome calls for, under its own key, and no memory up for reuse
// belongs to a batch in flight.
func TestPipelineMixedBatchesInReusedMemory(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := redistest.Store(t, uniquePrefix(t))
	var ran ranLog
	p, err := consumer.New("pipe-mixed", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		ran.add(m.ID, d)
		if d.Key.ID != m.ID {
			return nil, fmt.Errorf("message %s ran under key %s", m.ID, d.Key.ID)
		}
		switch m.ID[:2] {
		case "tr":
			return nil, consumer.Transient(errors.New("later"))
		case "pe":
			return nil, consumer.Permanent(errors.New("never"))
		case "pn":
			panic("boom " + m.ID)
		case "rj":
			return nil, consumer.Reject(errors.New("no"), []byte("rj:"+m.ID))
		}
		return []byte("r:" + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	pl := p.NewPipeline(3)
	rng := rand.New(rand.NewPCG(1, 2))
	kinds := []string{"ok", "ok", "ok", "ok", "tr", "pe", "pn", "rj", "dup", "nokey", "nil"}
	var (
		mu  sync.Mutex
		bad []string
	)
	const batches = 60
	for k := range batches {
		n := 1 + rng.IntN(40)
		ms := make([]*consumer.Message, 0, n)
		for i := range n {
			kind := kinds[rng.IntN(len(kinds))]
			id := kind + "-" + strconv.Itoa(k) + "-" + strconv.Itoa(i)
			switch kind {
			case "nil":
				ms = append(ms, nil)
				continue
			case "nokey":
				id = ""
			case "dup":
				if len(ms) > 0 && ms[len(ms)-1] != nil && ms[len(ms)-1].ID != "" {
					id = ms[len(ms)-1].ID // repeated: done alone, after the first
				} else {
					id = "ok-" + strconv.Itoa(k) + "-" + strconv.Itoa(i)
				}
			}
			ms = append(ms, msg(id))
		}
		want := slicesClone(ms)
		pl.Submit(ctx, ms, func(ds []consumer.Decision) {
			mu.Lock()
			defer mu.Unlock()
			fail := func(f string, a ...any) { bad = append(bad, fmt.Sprintf("batch %d: ", k)+fmt.Sprintf(f, a...)) }
			if pl.ReusesInFlight() {
				fail("the memory of a batch in flight is up for reuse")
			}
			if len(ds) != len(want) {
				fail("%d decisions for %d messages", len(ds), len(want))
				return
			}
			first := map[string]bool{}
			for i, m := range want {
				d := ds[i]
				if m == nil {
					if d.Action != consumer.Retry {
						fail("nil message %d: %v", i, d.Action)
					}
					continue
				}
				if m.ID == "" {
					if d.Action != consumer.DeadLettered {
						fail("message %d without a key: %v", i, d.Action)
					}
					continue
				}
				if d.Key.ID != m.ID {
					fail("message %d (%s) decided under key %q", i, m.ID, d.Key.ID)
					continue
				}
				repeat := first[m.ID]
				first[m.ID] = true
				kind := m.ID[:2]
				switch {
				case repeat && (kind == "ok" || kind == "rj"):
					// done alone after the first: a duplicate of its outcome
					if (kind == "ok" && (d.Action != consumer.Ack || !d.Duplicate || string(d.Result) != "r:"+m.ID)) ||
						(kind == "rj" && d.Action != consumer.Rejected && !(d.Action == consumer.Ack && d.Duplicate)) {
						fail("repeat %s: %+v", m.ID, d)
					}
				case repeat:
					// the first failed and was released (or kept): any but a fresh Ack of a success
					if d.Action == consumer.Ack && !d.Duplicate {
						fail("repeat of failed %s acked: %+v", m.ID, d)
					}
				case kind == "ok":
					if d.Action != consumer.Ack || d.Duplicate || string(d.Result) != "r:"+m.ID {
						fail("%s: %+v", m.ID, d)
					}
				case kind == "tr":
					if d.Action != consumer.Retry {
						fail("%s: %+v", m.ID, d)
					}
				case kind == "pe", kind == "pn":
					if (d.Action != consumer.Retry && d.Action != consumer.DeadLettered) || d.Class != consumer.ClassPermanent {
						fail("%s: %+v", m.ID, d)
					}
					if kind == "pn" && (d.Err == nil || !strings.Contains(d.Err.Error(), "boom "+m.ID)) {
						fail("%s: panic error %v", m.ID, d.Err)
					}
				case kind == "rj":
					if d.Action != consumer.Rejected || string(d.Result) != "rj:"+m.ID {
						fail("%s: %+v", m.ID, d)
					}
				}
			}
		})
		if pl.ReusesInFlight() {
			mu.Lock()
			bad = append(bad, fmt.Sprintf("after Submit %d: the memory of a batch in flight is up for reuse", k))
			mu.Unlock()
		}
	}
	pl.Wait()
	for _, b := range bad {
		t.Error(b)
	}
}

func slicesClone(ms []*consumer.Message) []*consumer.Message {
	return append([]*consumer.Message(nil), ms...)
}
