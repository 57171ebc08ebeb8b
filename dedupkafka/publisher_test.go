package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/dedupkit/dedup/outbox"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

func outboxBatch(n, keys int, topic string) []outbox.Message {
	b := make([]outbox.Message, n)
	for i := range b {
		b[i] = outbox.Message{ID: fmt.Sprintf("m%d", i), Topic: topic, Key: fmt.Sprintf("k%d", i%keys),
			Payload: fmt.Appendf(nil, "v%d", i), Headers: map[string]string{"traceparent": "00-x"}}
	}
	return b
}

// A produce response lost (the broker wrote the batch and answered
// REQUEST_TIMED_OUT) is retried by the idempotent producer without a
// duplicate in the log; a relay that re-sends the whole batch afterwards
// (its mark lost in a crash) doubles the log, and the consumer applies
// each event once.
func TestOutboxLostProduceResponse(t *testing.T) {
	c, seeds := cluster(t, 3, "events")
	h := c.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.Produce}, Err: kerr.RequestTimedOut, Count: 2})
	pub, err := NewPublisher(seeds)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	const n = 300
	batch := outboxBatch(n, 10, "events")
	res := make([]error, n)
	pub.Outbox().Publish(context.Background(), batch, res)
	for i, err := range res {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	if h.Hits() == 0 {
		t.Fatal("the fault never fired: the test proves nothing")
	}
	total := func() (s int64) {
		for _, o := range ends(t, seeds, "events") {
			s += o
		}
		return s
	}
	if got := total(); got != n {
		t.Fatalf("%d records in the log after lost responses, want %d (the idempotent producer wrote a duplicate)", got, n)
	}
	clear(res)
	pub.Outbox().Publish(context.Background(), batch, res) // the relay re-sends
	if got := total(); got != 2*n {
		t.Fatalf("%d records after the re-send, want %d", got, 2*n)
	}
	eff := newEffects()
	cons := newConsumer(t, seeds, "g", "events", processor(t, nil, eff, nil))
	stop := run(t, cons)
	allCommitted(t, seeds, "g", "events")
	stop()
	eff.check(t, n)
	if d := cons.Stats().Duplicates; d != n {
		t.Errorf("%d duplicates, want %d", d, n)
	}
	// Each key stays on one partition, in order.
	for k, ids := range eff.order {
		for j := 1; j < len(ids); j++ {
			var a, b int
			fmt.Sscanf(ids[j-1], "m%d", &a)
			fmt.Sscanf(ids[j], "m%d", &b)
			if a >= b {
				t.Fatalf("key %s out of order: %v", k, ids)
			}
		}
	}
}

// A message the broker refuses for itself (no such topic) is permanent;
// a topic name that cannot exist is refused before any I/O, and the later
// messages of its key are not sent.
func TestOutboxPermanentAndNotSent(t *testing.T) {
	_, seeds := cluster(t, 1, "events")
	pub, err := NewPublisher(seeds, WithProducerOptions(kgo.UnknownTopicRetries(0)))
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	batch := []outbox.Message{
		{ID: "a", Topic: "bad topic", Key: "k1"},
		{ID: "b", Topic: "events", Key: "k1"},
		{ID: "c", Topic: "events", Key: "k2"},
		{ID: "d", Topic: "missing", Key: "k3"},
	}
	res := make([]error, len(batch))
	pub.Outbox().Publish(context.Background(), batch, res)
	if !outbox.IsPermanent(res[0]) || !errors.Is(res[1], outbox.ErrNotSent) || res[2] != nil || !outbox.IsPermanent(res[3]) {
		t.Fatalf("results %v", res)
	}
}

func TestNewPublisherRefusesWeakening(t *testing.T) {
	for _, o := range []kgo.Opt{kgo.DisableIdempotentWrite(), kgo.RequiredAcks(kgo.LeaderAck())} {
		if _, err := NewPublisher([]string{"127.0.0.1:1"}, WithProducerOptions(o)); err == nil {
			t.Errorf("option %T accepted", o)
		}
	}
	if _, err := NewPublisher(nil); err == nil {
		t.Error("no brokers accepted")
	}
}

// The publisher lingers 0 unless told otherwise: the relay waits for each
// batch, so franz-go's default linger only delayed it.
func TestPublisherLingerDefault(t *testing.T) {
	for _, c := range []struct {
		opts []PublisherOption
		want time.Duration
	}{{nil, 0}, {[]PublisherOption{WithProducerOptions(kgo.ProducerLinger(5 * time.Millisecond))}, 5 * time.Millisecond}} {
		p, err := NewPublisher([]string{"127.0.0.1:1"}, c.opts...)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := p.Client().OptValue(kgo.ProducerLinger).(time.Duration)
		p.Close()
		if got != c.want {
			t.Errorf("linger %v, want %v", got, c.want)
		}
	}
}

// Each record of a batch carries its own ID, key, aggregate and headers
// (they share one buffer per batch), an empty key stays an empty key, not
// a null one, and each key's records reach its partition in batch order.
func TestOutboxRecordsOfABatch(t *testing.T) {
	_, seeds := cluster(t, 4, "events")
	pub, err := NewPublisher(seeds)
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	batch := outboxBatch(200, 7, "events")
	batch[5].Key = ""
	batch[6].Headers = map[string]string{HeaderMsgID: "forged", HeaderAggregate: "forged", "a": "1", "b": ""}
	res := make([]error, len(batch))
	pub.Outbox().Publish(context.Background(), batch, res)
	for i, err := range res {
		if err != nil {
			t.Fatalf("message %d: %v", i, err)
		}
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(seeds...), kgo.ConsumeTopics("events"), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	byID := map[string]*kgo.Record{}
	last := map[string]int{} // key -> index in batch of its last record seen
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for len(byID) < len(batch) {
		fs := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("%d of %d records read: %v", len(byID), len(batch), err)
		}
		fs.EachRecord(func(r *kgo.Record) {
			h := map[string]string{}
			for _, x := range r.Headers {
				if _, dup := h[x.Key]; dup {
					t.Errorf("record %s: header %s twice", r.Key, x.Key)
				}
				h[x.Key] = string(x.Value)
			}
			id := h[HeaderMsgID]
			var i int
			if _, err := fmt.Sscanf(id, "m%d", &i); err != nil || i >= len(batch) {
				t.Fatalf("record with ID %q", id)
			}
			m := batch[i]
			if r.Key == nil || string(r.Key) != m.Key || (m.Key != "" && h[HeaderAggregate] != m.Key) {
				t.Errorf("%s: key %q (nil %v), aggregate %q; want %q", id, r.Key, r.Key == nil, h[HeaderAggregate], m.Key)
			}
			if string(r.Value) != string(m.Payload) {
				t.Errorf("%s: value %q, want %q", id, r.Value, m.Payload)
			}
			for k, v := range m.Headers {
				if k != HeaderMsgID && k != HeaderAggregate && h[k] != v {
					t.Errorf("%s: header %s = %q, want %q", id, k, h[k], v)
				}
			}
			if j, ok := last[m.Key]; ok && j >= i {
				t.Errorf("key %q: %s after m%d", m.Key, id, j)
			}
			last[m.Key] = i
			byID[id] = r
		})
	}
}
