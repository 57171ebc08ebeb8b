package dedupkafka_test

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

// A record published twice under one message ID (a relay that re-sent it
// after a crash) takes effect once; the second copy is a duplicate whose
// offset is committed all the same. The cluster is franz-go's in-process
// kfake; give NewConsumer and NewPublisher your brokers instead.
func Example() {
	cluster, _ := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders"))
	defer cluster.Close()
	seeds := cluster.ListenAddrs()
	ctx := context.Background()

	pub, _ := dedupkafka.NewPublisher(seeds)
	defer pub.Close()
	charge := &consumer.Message{ID: "order-42/charge", Payload: []byte(`{"cents":1250}`)}
	_ = pub.Publish(ctx, "orders", charge)
	_ = pub.Publish(ctx, "orders", charge) // the re-send

	store, _ := memstore.New()
	defer store.Close()
	charged := 0
	p, _ := consumer.New("billing", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		charged++ // use d.Key as the payment provider's idempotency key
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithLogger(slog.New(slog.DiscardHandler)))
	c, _ := dedupkafka.NewConsumer(seeds, "billing", []string{"orders"}, p, dedupkafka.WithLogger(slog.New(slog.DiscardHandler)))
	go c.Run(ctx)
	for c.Stats().Final < 2 {
		time.Sleep(10 * time.Millisecond)
	}
	c.Close()
	st := c.Stats()
	fmt.Printf("charged %d time(s); %d records final, %d duplicate\n", charged, st.Final, st.Duplicates)
	// Output: charged 1 time(s); 2 records final, 1 duplicate
}

// A Transactor turns each order into an invoice record: the invoice and
// the order's offset commit in one Kafka transaction, and the charge, an
// effect outside Kafka, runs once per message ID, here also for the
// order re-sent under the same ID. A reader with read_committed sees one
// invoice.
func ExampleTransactor() {
	cluster, _ := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "orders", "invoices"))
	defer cluster.Close()
	seeds := cluster.ListenAddrs()
	ctx := context.Background()

	pub, _ := dedupkafka.NewPublisher(seeds)
	defer pub.Close()
	order := &consumer.Message{ID: "order-7", Payload: []byte(`{"cents":990}`)}
	_ = pub.Publish(ctx, "orders", order)
	_ = pub.Publish(ctx, "orders", order) // the re-send

	store, _ := memstore.New()
	defer store.Close()
	charged := 0
	tr, _ := dedupkafka.NewTransactor(seeds, "invoicing", "invoicing-1", []string{"orders"}, store, "invoicing",
		func(ctx context.Context, in dedupkafka.TxInput) ([]*kgo.Record, error) {
			// in.Attempt > 1: an earlier run may have charged; ask the
			// provider by in.Message.ID before charging again.
			charged++
			return []*kgo.Record{{Topic: "invoices", Value: in.Message.Payload}}, nil
		}, dedupkafka.WithTxLogger(slog.New(slog.DiscardHandler)))
	go tr.Run(ctx)
	for tr.Stats().Applied+tr.Stats().Duplicates < 2 {
		time.Sleep(10 * time.Millisecond)
	}
	tr.Close()

	rd, _ := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ConsumeTopics("invoices"),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	defer rd.Close()
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	invoices := rd.PollFetches(pctx).NumRecords()
	fmt.Printf("charged %d time(s), %d invoice(s) committed\n", charged, invoices)
	// Output: charged 1 time(s), 1 invoice(s) committed
}
