// Command deadletter puts one dead letter in a NATS JetStream dead-letter
// stream, so that the `dedup dlq` commands of the README have something to
// list, inspect and replay. It publishes a payment message whose handler
// fails permanently, lets the consumer runtime dead-letter it after its
// attempts, prints the record's ID and exits.
//
//	go run ./examples/deadletter                # stream DLQ on nats://127.0.0.1:4222
//	go run ./cmd/dedup dlq list --stream DLQ
//
// It needs a NATS server with JetStream (nats-server -js); --nats-url or
// $DEDUP_NATS_URL names another one. Each run adds one record.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/memstore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func main() {
	url := flag.String("nats-url", "", "NATS server URL (default: $DEDUP_NATS_URL or nats://127.0.0.1:4222)")
	dlqName := flag.String("stream", "DLQ", "dead-letter stream to create or use")
	flag.Parse()
	if *url == "" {
		*url = os.Getenv("DEDUP_NATS_URL")
	}
	if *url == "" {
		*url = nats.DefaultURL
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	id, err := deadLetterOne(ctx, *url, *dlqName, "DEMO_PAYMENTS")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("dead-lettered one message into stream %s as record %s\n", *dlqName, id)
	fmt.Printf("next: go run ./cmd/dedup dlq inspect --stream %s %s --payload\n", *dlqName, id)
}

// deadLetterOne publishes a message on stream (created if missing, its
// subjects "<stream>.>") whose handler always fails permanently, runs the
// consumer until the message is dead-lettered into dlqName, and returns
// the dead letter's record ID.
func deadLetterOne(ctx context.Context, url, dlqName, stream string) (string, error) {
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		return "", fmt.Errorf("connect to NATS at %s (start nats-server -js, or set --nats-url): %w", url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return "", err
	}
	subject := stream + ".charge"
	s, err := js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{stream + ".>"},
		MaxAge: time.Hour, Duplicates: time.Hour})
	if err != nil {
		return "", fmt.Errorf("create stream %s (is JetStream enabled? start nats-server with -js): %w", stream, err)
	}
	// Messages of earlier runs are dead letters already: start empty.
	if err := s.Purge(ctx); err != nil {
		return "", err
	}
	dlq, err := dedupnats.NewDLQ(ctx, js, dlqName)
	if err != nil {
		return "", err
	}
	before, err := dlq.List(ctx, "", 0)
	if err != nil {
		return "", err
	}
	store, err := memstore.New() // the demo's dedup store; sqlitestore or pgstore in production
	if err != nil {
		return "", err
	}
	defer store.Close()
	p, err := consumer.New("demo-billing", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, consumer.Permanent(errors.New("card declined: account closed"))
	}, consumer.WithDeadLetter(dlq), consumer.WithBackoff(10*time.Millisecond, 50*time.Millisecond),
		consumer.WithRetention(time.Hour)) // within the stream's duplicate window
	if err != nil {
		return "", err
	}
	// A durable consumer of this run's own, removed at the end.
	durable := fmt.Sprintf("demo-billing-%d", time.Now().UnixNano())
	c, err := dedupnats.NewConsumer(js, stream, durable, p)
	if err != nil {
		return "", err
	}
	defer func() {
		c.Close()
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		js.DeleteConsumer(dctx, stream, durable)
	}()
	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	go c.Run(runCtx)

	pub, err := dedupnats.NewPublisher(js)
	if err != nil {
		return "", err
	}
	msg := &consumer.Message{ID: fmt.Sprintf("payment-%d", time.Now().UnixNano()), Payload: []byte(`{"amount":1000,"currency":"EUR","card":"4000-0000-0000-0002"}`)}
	if _, err := pub.Publish(ctx, subject, msg); err != nil {
		return "", err
	}
	for {
		after, err := dlq.List(ctx, "", 0)
		if err != nil {
			return "", err
		}
		for _, dl := range after[len(before):] {
			if dl.Message.ID == msg.ID {
				return dl.ID, nil
			}
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("the message was not dead-lettered in time: %w", ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}
