package dedupkafka

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

var benchTopics atomic.Int64

// benchTopic creates a fresh 4-partition topic holding n records with
// message IDs.
func benchTopic(b *testing.B, seeds []string, n int) string {
	b.Helper()
	topic := fmt.Sprintf("bench-%d", benchTopics.Add(1))
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ProducerLinger(0))
	if err != nil {
		b.Fatal(err)
	}
	defer cl.Close()
	if _, err := kadm.NewClient(cl).CreateTopic(context.Background(), 4, 1, nil, topic); err != nil {
		b.Fatal(err)
	}
	rs := make([]*kgo.Record, n)
	for i := range rs {
		rs[i] = &kgo.Record{Topic: topic, Key: fmt.Appendf(nil, "k%d", i%64), Value: make([]byte, 128),
			Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: fmt.Appendf(nil, "%s-%d", topic, i)}}}
	}
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		b.Fatal(err)
	}
	return topic
}

// BenchmarkConsume compares, on one in-process kfake cluster, records/s
// through the dedupkafka consumer with memstore against a bare franz-go
// group consumer that commits each poll's offsets without dedup (the
// baseline). The timer starts at the first records, after the group join.
// Run with -count to rotate the cases within one process.
func BenchmarkConsume(b *testing.B) {
	c, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	seeds := c.ListenAddrs()
	groupOpts := []kgo.Opt{kgo.HeartbeatInterval(100 * time.Millisecond), kgo.FetchMaxWait(20 * time.Millisecond)}

	b.Run("bare", func(b *testing.B) {
		topic := benchTopic(b, seeds, b.N)
		b.ResetTimer()
		cl, err := kgo.NewClient(append(groupOpts, kgo.SeedBrokers(seeds...), kgo.ConsumerGroup("g-"+topic),
			kgo.ConsumeTopics(topic), kgo.DisableAutoCommit(), kgo.BlockRebalanceOnPoll())...)
		if err != nil {
			b.Fatal(err)
		}
		defer cl.Close()
		n := 0
		for n < b.N {
			fs := cl.PollRecords(context.Background(), 500)
			if n == 0 && fs.NumRecords() > 0 {
				b.ResetTimer() // the group is joined: time the consumption only
			}
			fs.EachRecord(func(*kgo.Record) { n++ })
			if err := cl.CommitUncommittedOffsets(context.Background()); err != nil {
				b.Fatal(err)
			}
			cl.AllowRebalance()
		}
		b.StopTimer()
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
	})

	for _, batch := range []int{1, 100} {
		name := "dedupkafka-memstore"
		if batch > 1 {
			name += fmt.Sprintf("-batch%d", batch)
		}
		b.Run(name, func(b *testing.B) {
			topic := benchTopic(b, seeds, b.N)
			store, err := memstore.New()
			if err != nil {
				b.Fatal(err)
			}
			defer store.Close()
			p, err := consumer.New("bench", store, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil },
				consumer.WithLogger(quiet), consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
			if err != nil {
				b.Fatal(err)
			}
			b.ResetTimer()
			cons, err := NewConsumer(seeds, "g-"+topic, []string{topic}, p, WithLogger(quiet), WithBatch(batch), WithClientOptions(groupOpts...))
			if err != nil {
				b.Fatal(err)
			}
			go cons.Run(context.Background())
			for cons.Stats().Records == 0 {
				time.Sleep(100 * time.Microsecond)
			}
			b.ResetTimer() // the group is joined: time the consumption only
			for cons.Stats().Final < uint64(b.N) {
				time.Sleep(time.Millisecond)
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "records/s")
			cons.Close()
		})
	}
}
