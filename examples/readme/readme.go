// Package readme holds the Go snippets of the repository's README.md, each
// inside a function that declares what the snippet takes for granted (a
// message, a store, a context), so that `go build ./...` and `go vet
// ./...` check that they compile. Its test checks that every Go block of
// README.md appears here verbatim: change a snippet in both places.
//
// Nothing here is meant to be called; the runnable versions are the
// Example functions of each package.
package readme

import (
	"context"
	"database/sql"
	"net/http"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/deduphttp"
	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
)

// brokerMessage is the message a snippet's consumer received, with the
// broker's acknowledgements.
type brokerMessage struct {
	ID, OrderID, Account string
	Amount               int64
	Body                 []byte
}

func (*brokerMessage) Ack()                        {}
func (*brokerMessage) Nack()                       {}
func (*brokerMessage) NackWithDelay(time.Duration) {}

// inbox is the README's transactional inbox on SQLite.
func inbox(ctx context.Context, msg *brokerMessage) error {
	store, err := sqlitestore.Open("app.db") // WAL, synchronous=FULL, schema applied
	if err != nil {
		return err
	}
	defer store.Close()

	key, err := dedup.NewKey("orders/billing-consumer", msg.ID) // scope is explicit
	if err != nil {
		return err // empty, oversized, invalid UTF-8 or control characters: never a silent pass
	}
	claim, err := store.RunInbox(ctx, key, dedup.FingerprintOf(msg.Body), 24*time.Hour,
		func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
			_, err := tx.ExecContext(ctx, `INSERT INTO invoices(order_id, amount) VALUES (?, ?)`, msg.OrderID, msg.Amount)
			return nil, err // an error rolls back both the record and the write
		})
	switch {
	case err != nil:
		msg.Nack() // store down or handler failed: nothing was recorded, redeliver
	case claim.Outcome == dedup.Duplicate, claim.Outcome == dedup.Acquired:
		msg.Ack() // applied now, or applied before: either way done
	default:
		msg.NackWithDelay(time.Second) // in progress elsewhere, or the ID was reused for another payload
	}
	return nil
}

// apply is the README's inbox in one round trip on PostgreSQL.
func apply(ctx context.Context, pgStore *pgstore.Store, key dedup.Key, msg *brokerMessage) (dedup.Claim, error) {
	var w pgx.Batch
	w.Queue(`INSERT INTO ledger (msg_id, account, amount) VALUES ($1, $2, $3)`, msg.ID, msg.Account, msg.Amount)
	w.Queue(`UPDATE balances SET amount = amount + $2 WHERE account = $1`, msg.Account, msg.Amount)
	claim, err := pgStore.Apply(ctx, key, dedup.FingerprintOf(msg.Body), 24*time.Hour, nil, &w)
	// err == nil and Acquired or Duplicate: ack. A *pgconn.PgError: a write failed, nothing applied.
	return claim, err
}

// runner is the README's effect outside the database, through a Runner.
func runner(ctx context.Context, store dedup.Store, key dedup.Key, msg *brokerMessage,
	charge func(context.Context, *brokerMessage, string) ([]byte, error)) error {
	r, err := dedup.NewRunner(store, dedup.WithLease(30*time.Second), dedup.WithRetention(24*time.Hour))
	if err != nil {
		return err // a bad option, refused before anything ran
	}
	res, err := r.Do(ctx, key, dedup.FingerprintOf(msg.Body), func(ctx context.Context) ([]byte, error) {
		return charge(ctx, msg, key.String()) // pass the key on as the provider's idempotency key
	})
	// err == nil: ack (res.Duplicate tells whether it ran now); err != nil: nack.
	_ = res
	return err
}

// natsConsumer is the README's consumer runtime on NATS JetStream.
func natsConsumer(ctx context.Context, js jetstream.JetStream, store dedup.Store,
	charge func(context.Context, *consumer.Message, string) ([]byte, error), lookupCharge consumer.Reconciler) error {
	dlq, _ := dedupnats.NewDLQ(ctx, js, "DLQ")
	p, _ := consumer.New("billing", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return charge(ctx, m, d.Key.String()) // d.Key: the provider's idempotency key
	}, consumer.WithDeadLetter(dlq), consumer.WithReconciler(lookupCharge))
	c, _ := dedupnats.NewConsumer(js, "ORDERS", "billing", p)
	err := c.Run(ctx)
	return err
}

// httpMiddleware is the README's Idempotency-Key middleware, keys bound to
// the tenant and the principal.
func httpMiddleware(store dedup.Store, mux *http.ServeMux, createPayment func(http.ResponseWriter, *http.Request)) {
	m, _ := deduphttp.New(store,
		deduphttp.WithTenant(deduphttp.TenantHeader("X-Tenant")),
		deduphttp.WithPrincipal(deduphttp.PrincipalHeader("Authorization")))
	mux.Handle("POST /payments", m.Required(http.HandlerFunc(createPayment)))
}

// rabbitConsumer is the README's consumer runtime on RabbitMQ.
func rabbitConsumer(ctx context.Context, url string, store dedup.Store, handle consumer.Handler, body []byte) error {
	dlq, _ := dedupamqp.NewDLQ(ctx, url, "orders.dlx", "billing")
	p, _ := consumer.New("billing", store, handle, consumer.WithDeadLetter(dlq))
	c, _ := dedupamqp.NewConsumer(url, "orders", p, dedupamqp.WithQueueType(dedupamqp.Quorum),
		dedupamqp.WithDeadLetterExchange(dlq.Exchange()), dedupamqp.WithConcurrency(8))
	err := c.Run(ctx)

	pub, _ := dedupamqp.NewPublisher(url) // confirm mode, mandatory, persistent
	err = pub.Publish(ctx, "orders", &consumer.Message{ID: "order-42/charge", Payload: body})
	return err
}

// kafkaConsumer is the README's Kafka section.
func kafkaConsumer(ctx context.Context, store dedup.Store, handle consumer.Handler, body []byte) error {
	seeds := []string{"127.0.0.1:9092"}
	dlq, _ := dedupkafka.NewDLQ(ctx, seeds, "orders.dlq")
	p, _ := consumer.New("billing", store, handle, consumer.WithDeadLetter(dlq))
	c, _ := dedupkafka.NewConsumer(seeds, "billing", []string{"orders"}, p, dedupkafka.WithConcurrency(8))
	err := c.Run(ctx)

	pub, _ := dedupkafka.NewPublisher(seeds) // idempotent, acks=all
	err = pub.Publish(ctx, "orders", &consumer.Message{ID: "order-42/charge", Payload: body})
	return err
}

// outboxWrite is the README's outbox row written in the business
// transaction.
func outboxWrite(ctx context.Context, s *pgstore.Store) error {
	var err error
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
	return err
}

// watermillRouter is the README's Watermill middleware and outbox
// publisher.
func watermillRouter(store dedup.Store, pub message.Publisher, router *message.Router, source outbox.Source) {
	mw, _ := dedupwatermill.New(store, "billing") // key: the message UUID; or WithMetadataKey
	poison, _ := middleware.PoisonQueueWithFilter(pub, "poison", dedupwatermill.ShouldPoison)
	retry := middleware.Retry{MaxRetries: 5, InitialInterval: 100 * time.Millisecond}
	router.AddMiddleware(poison, retry.Middleware, mw.Middleware) // this order
	// ... router.Run(ctx); after router.Close():
	mw.Close()

	op, _ := dedupwatermill.NewOutboxPublisher(pub) // stable outbox ID = Watermill UUID
	relay, _ := outbox.NewRelay(source, op)
	_ = relay
}
