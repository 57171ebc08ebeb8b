// Command watermill runs a Watermill router whose handler charges orders
// once each, with the dedupwatermill middleware on a SQLite store, while
// the broker (Watermill's in-process gochannel here; any Watermill
// subscriber in production) delivers every order several times.
//
//	go run ./examples/watermill --db orders.db --orders 100 --deliveries 3
//
// Each order is published --deliveries times under one message UUID. The
// handler writes a charge into a ledger table of the same SQLite database
// and produces a receipt message, which the router publishes on the
// "receipts" topic before it acks. The middleware (in the order the
// package documents: PoisonQueueWithFilter, Retry, dedup) runs the handler
// once per order; the duplicates are acked without a run and without a
// second receipt. Run it again on the same file: the keys are durable, so
// a replay of the same orders charges nothing.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"log"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/sqlitestore"
)

func main() {
	db := flag.String("db", "orders.db", "SQLite file holding the dedup keys and the ledger")
	orders := flag.Int("orders", 100, "distinct orders to publish")
	deliveries := flag.Int("deliveries", 3, "times the broker delivers each order")
	flag.Parse()
	s, err := run(context.Background(), *db, *orders, *deliveries)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Fprintf(os.Stdout, "delivered %d, charged %d (ledger holds %d), duplicates acked %d, receipts %d\n",
		s.Delivered, s.Charged, s.Ledger, s.Duplicates, s.Receipts)
}

// Summary is what one run did.
type Summary struct {
	Delivered  int // messages published (orders × deliveries)
	Charged    int // handler runs in this run
	Ledger     int // charges in the ledger, all runs together
	Duplicates uint64
	Receipts   int // receipts published in this run
}

func run(ctx context.Context, path string, orders, deliveries int) (Summary, error) {
	var sum Summary
	if orders < 1 || deliveries < 1 {
		return sum, fmt.Errorf("--orders and --deliveries must be positive")
	}
	store, err := sqlitestore.Open(path)
	if err != nil {
		return sum, err
	}
	defer store.Close()
	ledger := store.DB()
	if _, err := ledger.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS ledger (order_id TEXT PRIMARY KEY, amount INTEGER NOT NULL)`); err != nil {
		return sum, err
	}
	mw, err := dedupwatermill.New(store, "charges", dedupwatermill.WithLease(30*time.Second))
	if err != nil {
		return sum, err
	}
	logger := watermill.NopLogger{}
	pubSub := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, logger)
	defer pubSub.Close()
	receiptsCh, err := pubSub.Subscribe(ctx, "receipts")
	if err != nil {
		return sum, err
	}
	var receipts atomic.Int64
	go func() {
		for m := range receiptsCh {
			receipts.Add(1)
			m.Ack()
		}
	}()

	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return sum, err
	}
	poison, err := middleware.PoisonQueueWithFilter(pubSub, "poison", dedupwatermill.ShouldPoison)
	if err != nil {
		return sum, err
	}
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 10 * time.Millisecond, MaxInterval: time.Second, Multiplier: 2}
	router.AddMiddleware(poison, retry.Middleware, mw.Middleware)
	var charged atomic.Int64
	router.AddHandler("charge", "orders", pubSub, "receipts", pubSub, func(msg *message.Message) ([]*message.Message, error) {
		amount, err := strconv.Atoi(string(msg.Payload))
		if err != nil {
			return nil, err // goes to the poison queue after the retries
		}
		if err := charge(msg.Context(), ledger, msg.UUID, amount); err != nil {
			return nil, err
		}
		charged.Add(1)
		receipt := message.NewMessage("receipt-"+msg.UUID, msg.Payload) // a stable ID: derived, never random
		return message.Messages{receipt}, nil
	})
	runErr := make(chan error, 1)
	go func() { runErr <- router.Run(ctx) }()
	select {
	case <-router.Running():
	case err := <-runErr:
		return sum, err
	}

	for range deliveries {
		for i := range orders {
			msg := message.NewMessage("order-"+strconv.Itoa(i), []byte(strconv.Itoa(100+i)))
			if err := pubSub.Publish("orders", msg); err != nil {
				return sum, err
			}
			sum.Delivered++
		}
	}
	if err := router.Close(); err != nil {
		return sum, err
	}
	if err := <-runErr; err != nil {
		return sum, err
	}
	if err := mw.Close(); err != nil { // completes what the router acked
		return sum, err
	}
	if err := ledger.QueryRowContext(ctx, `SELECT count(*) FROM ledger`).Scan(&sum.Ledger); err != nil {
		return sum, err
	}
	sum.Charged, sum.Duplicates, sum.Receipts = int(charged.Load()), mw.Stats().Duplicates, int(receipts.Load())
	return sum, nil
}

// charge records one charge. The primary key makes a second charge of one
// order fail loudly rather than pass: the middleware is the first line,
// the ledger's constraint the last.
func charge(ctx context.Context, db *sql.DB, orderID string, amount int) error {
	_, err := db.ExecContext(ctx, `INSERT INTO ledger (order_id, amount) VALUES (?, ?)`, orderID, amount)
	return err
}
