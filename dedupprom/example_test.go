package dedupprom_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/dedupamqp"
	"github.com/dedupkit/dedup/dedupkafka"
	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/dedupprom"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// A Runner and a consumer processor feed one registry; /metrics serves it.
func Example() {
	m, err := dedupprom.New(dedupprom.WithMaxScopes(20))
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)

	store, err := memstore.New()
	if err != nil {
		panic(err)
	}
	r, err := dedup.NewRunner(store, dedup.WithName("memory"), dedup.WithHooks(m))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	key := dedup.Key{Scope: "payments", ID: "charge-1"}
	for range 2 {
		if _, err := r.Do(ctx, key, "", func(context.Context) ([]byte, error) { return []byte("ok"), nil }); err != nil {
			panic(err)
		}
	}

	p, err := consumer.New("orders", store, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) {
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}), consumer.WithObserver(m.Observer("orders")))
	if err != nil {
		panic(err)
	}
	reg.MustRegister(m.ProcessorCollector("orders", p.Stats))
	p.Process(ctx, &consumer.Message{ID: "m-1", Subject: "orders.placed"})

	mux := http.NewServeMux()
	mux.Handle("/metrics", dedupprom.Handler(reg)) // on the admin listener

	n, err := testutil.GatherAndCount(reg, "dedup_duplicates_total", "dedup_consumer_decisions_total")
	fmt.Println(n, err)
	// Output: 6 <nil>
}

// Parts that keep their own counters are read at each scrape: map a broker
// adapter's Stats into BrokerStats, its reported backlog into BrokerLag, a
// sweeper's Stats into SweepStats.
func ExampleMetrics_BrokerCollector() {
	m, err := dedupprom.New()
	if err != nil {
		panic(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(m)

	var c *dedupnats.Consumer // from dedupnats.NewConsumer
	reg.MustRegister(m.BrokerCollector("nats", "billing", func() dedupprom.BrokerStats {
		s := c.Stats()
		return dedupprom.BrokerStats{Fetched: s.Fetched, Acked: s.Acked, Nacked: s.Naked,
			DeadLetters: s.Terminated, AckErrors: s.AckErrors}
	}))

	// The backlog the broker reports, asked at each scrape.
	reg.MustRegister(m.LagCollector("nats", "billing", func(ctx context.Context) (dedupprom.BrokerLag, error) {
		l, err := c.Lag(ctx)
		return dedupprom.BrokerLag{Pending: int64(l.Pending), Unacked: int64(l.AckPending)}, err
	}))
	var kc *dedupkafka.Consumer // from dedupkafka.NewConsumer
	reg.MustRegister(m.LagCollector("kafka", "billing", func(ctx context.Context) (dedupprom.BrokerLag, error) {
		l, err := kc.Lag(ctx)
		return dedupprom.BrokerLag{Pending: l.Total, Unacked: -1}, err
	}))
	var ac *dedupamqp.Consumer // from dedupamqp.NewConsumer
	reg.MustRegister(m.LagCollector("rabbitmq", "billing", func(ctx context.Context) (dedupprom.BrokerLag, error) {
		d, err := ac.Depth(ctx)
		return dedupprom.BrokerLag{Pending: int64(d.Ready), Unacked: -1}, err
	}))

	var job *pgstore.SweepJob // from pgstore.Store's sweeper
	reg.MustRegister(m.SweepCollector("postgres", func() dedupprom.SweepStats {
		total, passes, lastErr := job.Stats()
		return dedupprom.SweepStats{Deleted: int64(total.Deleted), Passes: passes, Failed: lastErr != nil}
	}))
}
