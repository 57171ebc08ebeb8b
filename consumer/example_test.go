package consumer_test

import (
	"context"
	"fmt"

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
