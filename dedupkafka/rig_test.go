package dedupkafka

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
)

var quiet = slog.New(slog.DiscardHandler)

// cluster starts an in-process kfake cluster with topic of parts
// partitions and returns its seed addresses.
func cluster(t *testing.T, parts int32, topics ...string) (*kfake.Cluster, []string) {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(parts, topics...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c, c.ListenAddrs()
}

// produce writes n records to topic: ID "m<i>", key "k<i % keys>".
func produce(t *testing.T, seeds []string, topic string, n, keys int, extra func(i int, r *kgo.Record)) {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	rs := make([]*kgo.Record, n)
	for i := range n {
		rs[i] = &kgo.Record{Topic: topic, Key: fmt.Appendf(nil, "k%d", i%keys), Value: fmt.Appendf(nil, "v%d", i),
			Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: fmt.Appendf(nil, "m%d", i)}}}
		if extra != nil {
			extra(i, rs[i])
		}
	}
	if err := cl.ProduceSync(context.Background(), rs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
}

// effects counts the handler's effects per message ID, and keeps each
// key's order of application.
type effects struct {
	mu    sync.Mutex
	n     map[string]int
	order map[string][]string
}

func newEffects() *effects { return &effects{n: map[string]int{}, order: map[string][]string{}} }

func (e *effects) apply(m *consumer.Message) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.n[m.ID]++
	e.order[m.Aggregate] = append(e.order[m.Aggregate], m.ID)
}

func (e *effects) distinct() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.n)
}

// check fails unless each of the n IDs took effect exactly once.
func (e *effects) check(t *testing.T, n int) {
	t.Helper()
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := range n {
		id := fmt.Sprintf("m%d", i)
		if e.n[id] != 1 {
			t.Errorf("%s took effect %d times, want 1", id, e.n[id])
		}
	}
	if len(e.n) != n {
		t.Errorf("%d distinct effects, want %d", len(e.n), n)
	}
}

// waitFor polls cond every few milliseconds until it holds or a minute
// passes (a bound against a hung test, not a timing assertion).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// processor returns a processor on a fresh memstore whose handler records
// an effect and then calls h (nil: succeed).
func processor(t *testing.T, store *memstore.Store, eff *effects, h consumer.Handler, opts ...consumer.Option) *consumer.Processor {
	t.Helper()
	if store == nil {
		var err error
		if store, err = memstore.New(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { store.Close() })
	}
	p, err := consumer.New("kafka-test", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if h != nil {
			if out, err := h(ctx, m, d); err != nil {
				return out, err
			}
		}
		eff.apply(m)
		return nil, nil
	}, append([]consumer.Option{consumer.WithLogger(quiet), consumer.WithBackoff(time.Millisecond, 20*time.Millisecond),
		consumer.WithLease(5 * time.Second), consumer.WithDeadLetter(&consumer.MemoryDLQ{})}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// run starts c.Run on a goroutine; the returned function stops it and
// returns Run's error.
func run(t *testing.T, c *Consumer) func() error {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() {
			c.Close()
			err = <-errc
		})
		return err
	}
	t.Cleanup(func() { stop() })
	return stop
}

func newConsumer(t *testing.T, seeds []string, group, topic string, p *consumer.Processor, opts ...ConsumerOption) *Consumer {
	t.Helper()
	c, err := NewConsumer(seeds, group, []string{topic}, p, append([]ConsumerOption{WithLogger(quiet),
		WithClientOptions(kgo.HeartbeatInterval(100*time.Millisecond), kgo.SessionTimeout(6*time.Second),
			kgo.RebalanceTimeout(6*time.Second), kgo.FetchMaxWait(50*time.Millisecond))}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// committed returns the group's committed offsets of topic, by partition.
func committed(t *testing.T, seeds []string, group, topic string) map[int32]int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	out := map[int32]int64{}
	offs, err := kadm.NewClient(cl).FetchOffsets(context.Background(), group)
	if err != nil {
		return out // no such group yet: nothing committed
	}
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Topic == topic {
			out[o.Partition] = o.At
		}
	})
	return out
}

// ends returns topic's end offsets by partition.
func ends(t *testing.T, seeds []string, topic string) map[int32]int64 {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	lo, err := kadm.NewClient(cl).ListEndOffsets(context.Background(), topic)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int32]int64{}
	lo.Each(func(o kadm.ListedOffset) { out[o.Partition] = o.Offset })
	return out
}

// allCommitted waits until the group has committed topic to its end.
func allCommitted(t *testing.T, seeds []string, group, topic string) {
	t.Helper()
	want := ends(t, seeds, topic)
	waitFor(t, "offsets committed to the end", func() bool {
		got := committed(t, seeds, group, topic)
		for p, o := range want {
			if got[p] != o {
				return false
			}
		}
		return true
	})
}
