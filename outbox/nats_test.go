package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/dedupnats"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// jetStream connects to the real NATS server and makes a memory stream of
// the test's own on subjects "<name>.>", deleted when the test ends.
func jetStream(t testing.TB) (jetstream.JetStream, string) {
	t.Helper()
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second))
	if err != nil {
		if testenv.Required() {
			t.Fatalf("NATS at DEDUP_NATS_URL=%s: %v", url, err)
		}
		t.Skipf("NATS not reachable at %s (set DEDUP_NATS_URL): %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("OUTBOX_%08x", rand.Uint32())
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { js.DeleteStream(context.Background(), name) })
	return js, name
}

// readStream returns the stream's messages in stream order.
func readStream(t *testing.T, js jetstream.JetStream, stream string, want int) []jetstream.Msg {
	t.Helper()
	ctx := context.Background()
	c, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{AckPolicy: jetstream.AckNonePolicy})
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for len(out) < want {
		b, err := c.Fetch(want-len(out), jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range b.Messages() {
			out = append(out, m)
			n++
		}
		if n == 0 {
			break
		}
	}
	return out
}

// Through the real JetStream server: a relay killed between the acks and
// the mark, another taking over; the stream holds each event once (the
// re-sends carry the same Nats-Msg-Id and fall in the duplicate window),
// each key in order, with the envelope a dedupnats.Consumer reads.
func TestRelayToJetStream(t *testing.T) {
	t.Parallel()
	js, stream := jetStream(t)
	r := newRig(t, pgstore.WithOutboxPartitions(4))
	pub, err := dedupnats.NewOutboxPublisher(js, 10*time.Second, dedupnats.WithExpectStream(stream))
	if err != nil {
		t.Fatal(err)
	}
	const n, keys = 600, 12
	for i := range n {
		r.write(outbox.Message{ID: fmt.Sprint("evt-", i), Topic: stream + ".orders", Key: fmt.Sprint("agg-", i%keys),
			Payload: []byte(fmt.Sprint(i)), Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}})
	}
	boom := errors.New("killed after the acks")
	var once sync.Once
	_, errc := r.run(pub, outbox.WithRelayID("doomed"), outbox.WithBatchSize(100), outbox.WithMarkHook(func(int, []outbox.Message) error {
		var err error
		once.Do(func() { err = boom })
		return err
	}))
	if err := <-errc; !errors.Is(err, boom) {
		t.Fatalf("Run = %v", err)
	}
	if r.count(`published_at IS NULL`) == 0 {
		t.Fatal("nothing left unmarked by the crash")
	}
	r.run(pub, outbox.WithRelayID("heir"), outbox.WithBatchSize(100))
	eventually(t, "every row published", func() bool { return r.count(`published_at IS NULL`) == 0 })
	msgs := readStream(t, js, stream, n+50)
	if len(msgs) != n {
		t.Fatalf("the stream holds %d messages, want %d (one per event)", len(msgs), n)
	}
	last := map[string]int{}
	for _, m := range msgs {
		var i int
		fmt.Sscan(string(m.Data()), &i)
		h := m.Headers()
		if h.Get(dedupnats.HeaderMsgID) != fmt.Sprint("evt-", i) || h.Get(jetstream.MsgIDHeader) != fmt.Sprint("evt-", i) || h.Get("traceparent") == "" {
			t.Fatalf("message %d headers %v", i, h)
		}
		k := h.Get(dedupnats.HeaderAggregate)
		if prev, ok := last[k]; ok && i <= prev {
			t.Fatalf("key %s: event %d after %d", k, i, prev)
		}
		last[k] = i
	}
	if len(last) != keys {
		t.Fatalf("%d keys in the stream", len(last))
	}
}
