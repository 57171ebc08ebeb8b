package consumer_test

import (
	"context"
	"fmt"
	"sync"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
)

// A processor turns each delivery into a decision for the broker adapter
// (ack, retry with a delay, dead-letter); the handler runs once per
// message ID however often the message is delivered.
func Example() {
	store, _ := memstore.New()
	defer store.Close()
	charges := 0
	p, err := consumer.New("payments", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		charges++
		return []byte("receipt for " + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{})) // poison messages are kept, never dropped
	if err != nil {
		panic(err)
	}
	msg := &consumer.Message{ID: "evt-1", Payload: []byte(`{"amount":100}`)}
	for delivery := 1; delivery <= 2; delivery++ {
		msg.Delivery = delivery
		d := p.Process(context.Background(), msg)
		fmt.Println(d.Action, d.Duplicate, string(d.Result))
	}
	fmt.Println("charges:", charges)
	// Output:
	// ack false receipt for evt-1
	// ack true receipt for evt-1
	// charges: 1
}

// A lane per goroutine: each worker processes its messages on a lane of
// its own, so that the workers do not all write one counter a message.
// The processor's Stats count the lanes' decisions while they are open;
// Close moves a lane's counts to the processor once its worker is done.
func ExampleProcessor_NewLane() {
	store, _ := memstore.New()
	defer store.Close()
	p, err := consumer.New("payments", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return []byte("receipt for " + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		panic(err)
	}
	var wg sync.WaitGroup
	for w := range 3 {
		wg.Go(func() {
			lane := p.NewLane()
			defer lane.Close() // without it p keeps the lane (and adds it in at each Stats) for good
			for i := range 4 {
				// Every message is delivered twice: the second is a duplicate.
				m := &consumer.Message{ID: fmt.Sprintf("evt-%d-%d", w, i), Payload: []byte(`{}`)}
				for delivery := 1; delivery <= 2; delivery++ {
					m.Delivery = delivery
					lane.Process(context.Background(), m)
				}
			}
		})
	}
	wg.Wait()
	s := p.Stats()
	fmt.Println("applied:", s.Applied, "duplicates:", s.Duplicates)
	// Output:
	// applied: 12 duplicates: 12
}

// A pipeline's done acknowledges its batch's messages and hands the
// decisions back with Recycle, so that a later batch is decided in their
// memory: done keeps nothing of them (a copy of a field is fine, ds or
// &ds[i] is not). Recycle is optional; a done that keeps the decisions
// does not call it.
func ExamplePipeline_Recycle() {
	store, _ := memstore.New()
	defer store.Close()
	p, err := consumer.New("payments", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return []byte("receipt for " + m.ID), nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		panic(err)
	}
	pl := p.NewPipeline(2)
	acked := []string{} // the adapter's acknowledgements, copied out
	for _, ids := range [][]string{{"evt-1", "evt-2"}, {"evt-2", "evt-3"}} {
		batch := make([]*consumer.Message, len(ids))
		for i, id := range ids {
			batch[i] = &consumer.Message{ID: id, Delivery: 1}
		}
		pl.Submit(context.Background(), batch, func(ds []consumer.Decision) {
			for i, d := range ds {
				if d.Acknowledge() {
					acked = append(acked, fmt.Sprint(batch[i].ID, " duplicate=", d.Duplicate))
				}
			}
			pl.Recycle(ds) // nothing reads ds any more
		})
	}
	pl.Wait()
	for _, a := range acked {
		fmt.Println(a)
	}
	// Output:
	// evt-1 duplicate=false
	// evt-2 duplicate=false
	// evt-2 duplicate=true
	// evt-3 duplicate=false
}
