package dedupnats_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/memstore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Example wires a deduplicating consumer, its dead-letter stream and a
// publisher. It needs a NATS server with JetStream, so it is compiled but
// not run by go test; the package tests run the same wiring against a real
// server.
func Example() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()

	nc, err := nats.Connect(nats.DefaultURL)
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: "ORDERS", Subjects: []string{"orders.>"}, Duplicates: 0, // the server's default window, 2m
	}); err != nil {
		log.Fatal(err)
	}

	dlq, err := dedupnats.NewDLQ(ctx, js, "ORDERS_DLQ")
	if err != nil {
		log.Fatal(err)
	}
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
	c, err := dedupnats.NewConsumer(js, "ORDERS", "billing", p)
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	go func() {
		if err := c.Run(ctx); err != nil && ctx.Err() == nil {
			log.Print(err)
		}
	}()

	pub, err := dedupnats.NewPublisher(js)
	if err != nil {
		log.Fatal(err)
	}
	// The ID is made once per logical event and reused on every retry.
	msg := &consumer.Message{ID: "order-1001/placed", BusinessKey: "order-1001", Payload: []byte(`{"total":42}`)}
	for range 2 {
		dup, err := pub.Publish(ctx, "orders.placed", msg)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println("broker saw a duplicate:", dup)
	}

	// Later, after fixing what made messages fail:
	rep, err := consumer.Replay(ctx, dlq, pub, consumer.ReplayOptions{Store: store})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("replayed:", rep.Replayed, "already completed:", rep.AlreadyCompleted)
	<-ctx.Done()
}
