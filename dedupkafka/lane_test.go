package dedupkafka

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
)

// Review of a9d4886 (record mode counts on lanes): one processor shared
// by two consumers, the first closed while both run (its lanes closed
// while the second's are open), handlers that panic on some records. The
// processor's Stats never go back while they run, and once both are
// closed every final record of each consumer is counted once by the
// processor: applied, duplicate or dead-lettered.
func TestSharedProcessorLanesAcrossConsumers(t *testing.T) {
	_, seeds := cluster(t, 6, "orders")
	const n = 3000
	produce(t, seeds, "orders", n, 64, nil)
	store, _ := memstore.New()
	defer store.Close()
	eff := newEffects()
	var seen atomic.Int64
	joined := make(chan struct{}) // closed once the second consumer runs
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if seen.Add(1) > 500 {
			<-joined // the first consumer keeps records for the second
		}
		if i, _ := strconv.Atoi(m.ID[1:]); i%97 == 0 {
			panic("poison " + m.ID)
		}
		return nil, nil
	}
	p := processor(t, store, eff, h)
	stop := make(chan struct{})
	var reader sync.WaitGroup
	reader.Go(func() {
		var last consumer.Stats
		for {
			s := p.Stats()
			if s.Applied < last.Applied || s.Duplicates < last.Duplicates || s.DeadLettered < last.DeadLettered || s.Retries < last.Retries {
				t.Errorf("processor stats went back: %+v after %+v", s, last)
				return
			}
			last = s
			select {
			case <-stop:
				return
			default:
			}
		}
	})
	opts := []ConsumerOption{WithMaxPollRecords(50), WithConcurrency(4)}
	c1 := newConsumer(t, seeds, "g", "orders", p, opts...)
	stop1 := run(t, c1)
	waitFor(t, "first records", func() bool { return seen.Load() > 200 })
	c2 := newConsumer(t, seeds, "g", "orders", p, opts...)
	stop2 := run(t, c2)
	close(joined)
	// The second consumer's lanes are open (or made) while the first
	// consumer closes its own; it may get no record (the first may have
	// run them all by the rebalance).
	waitFor(t, "the rebalance", func() bool { return c1.Stats().Revoked > 0 })
	if err := stop1(); err != nil {
		t.Fatal(err)
	}
	allCommitted(t, seeds, "g", "orders")
	if err := stop2(); err != nil {
		t.Fatal(err)
	}
	close(stop)
	reader.Wait()
	s1, s2, ps := c1.Stats(), c2.Stats(), p.Stats()
	if got, want := ps.Applied+ps.Duplicates+ps.DeadLettered+ps.Rejected, s1.Final+s2.Final; got != want || ps.Duplicates != s1.Duplicates+s2.Duplicates ||
		ps.DeadLettered != s1.DeadLettered+s2.DeadLettered || ps.DeadLettered == 0 {
		t.Errorf("processor %+v counts %d final decisions, the consumers %d (c1 %+v, c2 %+v)", ps, got, want, s1, s2)
	}
}
