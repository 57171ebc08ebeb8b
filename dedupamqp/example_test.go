package dedupamqp_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/memstore"
)

// Example wires a deduplicating RabbitMQ consumer, its dead-letter
// exchange and a confirm-mode publisher. It needs a RabbitMQ server, so
// it is compiled but not run by go test; the package tests run the same
// wiring against a real server.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	const url = "amqp://guest:guest@127.0.0.1:5672/"

	dlq, err := dedupamqp.NewDLQ(ctx, url, "orders.dlx", "billing")
	if err != nil {
		log.Fatal(err)
	}
	defer dlq.Close()
	store, err := memstore.New() // sqlitestore, redisstore or pgstore in production
	if err != nil {
		log.Fatal(err)
	}
	p, err := consumer.New("billing", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		// d.Key is the stable idempotency key for any external call.
		fmt.Printf("charging for %s (key %s)\n", m.ID, d.Key)
		return nil, nil
	}, consumer.WithDeadLetter(dlq))
	if err != nil {
		log.Fatal(err)
	}
	// A quorum queue whose delivery limit dead-letters to the same
	// exchange as the processor, so nothing is dropped.
	c, err := dedupamqp.NewConsumer(url, "orders", p,
		dedupamqp.WithQueueType(dedupamqp.Quorum), dedupamqp.WithDeliveryLimit(20),
		dedupamqp.WithDeadLetterExchange(dlq.Exchange()), dedupamqp.WithPrefetch(64), dedupamqp.WithConcurrency(8))
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	go func() {
		if err := c.Run(ctx); err != nil && ctx.Err() == nil {
			log.Print(err)
		}
	}()

	pub, err := dedupamqp.NewPublisher(url)
	if err != nil {
		log.Fatal(err)
	}
	defer pub.Close()
	// The ID is set once per logical event and reused by every retry.
	m := &consumer.Message{ID: "order-42/charge", Payload: []byte(`{"amount_cents":4200}`)}
	if err := pub.Publish(ctx, "orders", m); err != nil {
		log.Fatal(err) // a *dedupamqp.ReturnError when no queue is bound
	}
	<-ctx.Done()
}
