package outbox_test

import (
	"context"
	"log"
	"time"

	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Writing an event in the business transaction: it commits with the
// change, or not at all.
func Example_write() {
	ctx := context.Background()
	s, err := pgstore.Open(ctx, "postgres://app@db:5432/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	err = pgx.BeginFunc(ctx, s.Pool(), func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = $1`, 42); err != nil {
			return err
		}
		return s.WriteOutbox(ctx, tx, outbox.Message{
			ID:      outbox.NewID("shop"), // stable: stored with the row, sent on every attempt
			Topic:   "orders.paid",
			Key:     "order/42", // per-key order and partitioning
			Payload: []byte(`{"order":42}`),
		})
	})
	if err != nil {
		log.Fatal(err)
	}
}

// Running the relay: PostgreSQL outbox to NATS JetStream, 16 partitions
// shared by every relay started this way.
func Example_relay() {
	ctx := context.Background()
	s, err := pgstore.Open(ctx, "postgres://app@db:5432/shop")
	if err != nil {
		log.Fatal(err)
	}
	defer s.Close()
	src, err := s.OutboxSource(pgstore.WithOutboxPartitions(16))
	if err != nil {
		log.Fatal(err)
	}
	nc, err := nats.Connect("nats://nats:4222")
	if err != nil {
		log.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		log.Fatal(err)
	}
	pub, err := dedupnats.NewOutboxPublisher(js, 30*time.Second)
	if err != nil {
		log.Fatal(err)
	}
	relay, err := outbox.NewRelay(src, pub, outbox.WithRetention(24*time.Hour, 1000, time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	if err := relay.Run(ctx); err != nil { // until ctx ends or relay.Close
		log.Fatal(err)
	}
}
