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
