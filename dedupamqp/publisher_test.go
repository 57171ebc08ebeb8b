package dedupamqp

import (
	"bytes"
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/outbox"
	amqp "github.com/rabbitmq/amqp091-go"
)

// cutConn drops the TCP connection right after writing a frame that
// holds marker, the first time: the broker gets the publish, the
// publisher never gets its confirm.
// cutConn drops its connection right after writing the first frame that
// holds marker (once across all connections sharing cut). Its reads fail
// from the moment it decides to cut, before the write: the broker's answer
// to that frame (the confirm) is never seen, however fast it comes back.
type cutConn struct {
	net.Conn
	marker []byte
	cut    *atomic.Bool
	dead   atomic.Bool
}

func (c *cutConn) Write(p []byte) (int, error) {
	if bytes.Contains(p, c.marker) && c.cut.CompareAndSwap(false, true) {
		c.dead.Store(true)
		n, err := c.Conn.Write(p)
		c.Conn.Close()
		return n, err
	}
	return c.Conn.Write(p)
}

func (c *cutConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.dead.Load() {
		return 0, net.ErrClosed
	}
	return n, err
}

func TestPublisherResendsLostConfirmUnderSameID(t *testing.T) {
	r := newRig(t)
	var cut atomic.Bool
	var dials atomic.Int32
	cfg := amqp.Config{Dial: func(network, addr string) (net.Conn, error) {
		dials.Add(1)
		c, err := net.DialTimeout(network, addr, 10*time.Second)
		if err != nil {
			return nil, err
		}
		return &cutConn{Conn: c, marker: []byte("LOSE-MY-CONFIRM"), cut: &cut}, nil
	}}
	pub, err := NewPublisher(r.url, WithPublisherDialConfig(cfg), WithPublishRetries(5, 10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()

	var mu sync.Mutex
	var ids []string
	p := r.processor("confirm", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		mu.Lock()
		ids = append(ids, m.ID)
		mu.Unlock()
		r.effect(m.ID)
		return nil, nil
	})
	c := r.consumer(p)
	r.declare(c)
	if err := pub.Publish(ctxT(t), r.queue, &consumer.Message{ID: "c-1", Payload: []byte("LOSE-MY-CONFIRM")}); err != nil {
		t.Fatalf("publish across a lost confirm: %v", err)
	}
	if !cut.Load() || dials.Load() != 2 {
		t.Fatalf("cut %v after %d dials: the confirm was not lost as planned", cut.Load(), dials.Load())
	}
	r.run(c)
	waitFor(t, "applied and the queue drained", func() bool {
		return r.applied() == 1 && queueDepth(t, r) == 0 && c.Stats().Acked == c.Stats().Delivered
	})
	r.checkOnce([]string{"c-1"})
	st := c.Stats()
	// The first copy reached the broker before the cut (almost always):
	// then two deliveries under one ID, one effect.
	t.Logf("deliveries %d, duplicates %d", st.Delivered, p.Stats().Duplicates)
	if st.Delivered == 2 && p.Stats().Duplicates != 1 {
		t.Errorf("two copies but %d duplicates", p.Stats().Duplicates)
	}
}

func TestOutboxPublisher(t *testing.T) {
	r := newRig(t)
	p := r.processor("outbox", r.applyOnce())
	c := r.consumer(p)
	r.declare(c)
	batch := []outbox.Message{
		{ID: "o-1", Topic: r.queue, Payload: []byte("1")},
		{ID: "o-2", Topic: unique("nowhere"), Payload: []byte("2")},
		{ID: "o-3", Topic: r.queue, Payload: []byte("3"), Headers: map[string]string{"traceparent": "00-x"}},
	}
	results := make([]error, len(batch))
	r.pub.Outbox(10*time.Second).Publish(ctxT(t), batch, results)
	if results[0] != nil || results[2] != nil {
		t.Fatalf("results %v", results)
	}
	if !outbox.IsPermanent(results[1]) {
		t.Errorf("unroutable result %v is not permanent", results[1])
	}
	r.run(c)
	waitFor(t, "both applied", func() bool { return r.applied() == 2 })
	r.checkOnce([]string{"o-1", "o-3"})
}

func TestArgumentErrorsBeforeIO(t *testing.T) {
	mem := &consumer.MemoryDLQ{}
	proc, err := consumer.New("args", storeStub{}, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil }, consumer.WithDeadLetter(mem))
	if err != nil {
		t.Fatal(err)
	}
	const url = "amqp://guest:guest@127.0.0.1:1/" // nothing listens: no I/O may happen
	cases := []struct {
		name string
		err  func() error
	}{
		{"nil processor", func() error { _, err := NewConsumer(url, "q", nil); return err }},
		{"empty queue", func() error { _, err := NewConsumer(url, "", proc); return err }},
		{"amq. queue", func() error { _, err := NewConsumer(url, "amq.x", proc); return err }},
		{"bad url", func() error { _, err := NewConsumer("http://x", "q", proc); return err }},
		{"prefetch", func() error { _, err := NewConsumer(url, "q", proc, WithPrefetch(0)); return err }},
		{"concurrency over prefetch", func() error {
			_, err := NewConsumer(url, "q", proc, WithPrefetch(2), WithConcurrency(3))
			return err
		}},
		{"queue type", func() error { _, err := NewConsumer(url, "q", proc, WithQueueType("stream")); return err }},
		{"limit on classic", func() error { _, err := NewConsumer(url, "q", proc, WithDeliveryLimit(3)); return err }},
		{"no retry delay", func() error { _, err := NewConsumer(url, "q", proc, WithRetryDelays()); return err }},
		{"library recovery", func() error {
			_, err := NewConsumer(url, "q", proc, WithDialConfig(amqp.Config{Recovery: &amqp.Recovery{}}))
			return err
		}},
		{"publisher attempts", func() error { _, err := NewPublisher(url, WithPublishRetries(0, 0)); return err }},
		{"publish without ID", func() error {
			pub, err := NewPublisher(url)
			if err != nil {
				return err
			}
			return pub.Publish(context.Background(), "q", &consumer.Message{})
		}},
	}
	for _, tc := range cases {
		var ae *dedup.ArgumentError
		if err := tc.err(); !errors.As(err, &ae) {
			t.Errorf("%s: %v, want a *dedup.ArgumentError", tc.name, err)
		}
	}
}

// storeStub is a store that must never be called.
type storeStub struct{ dedup.Store }

func TestWarnings(t *testing.T) {
	proc, err := consumer.New("w", storeStub{}, func(context.Context, *consumer.Message, consumer.Delivery) ([]byte, error) { return nil, nil }, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	const url = "amqp://127.0.0.1:1/"
	for _, tc := range []struct {
		opts []ConsumerOption
		want WarningKind
	}{
		{nil, ClassicNoDeadLetter},
		{[]ConsumerOption{WithQueueType(Quorum), WithDeliveryLimit(5)}, QuorumDropsAtLimit},
		{[]ConsumerOption{WithQueueType(Quorum)}, QuorumDropsAtLimit},
		{[]ConsumerOption{WithoutDeclare(), WithDeadLetterExchange("dlx")}, QueueNotChecked},
		{[]ConsumerOption{WithQueueType(Quorum), WithDeadLetterExchange("dlx")}, 0},
	} {
		c, err := NewConsumer(url, "q", proc, tc.opts...)
		if err != nil {
			t.Fatal(err)
		}
		ws := c.Warnings()
		switch {
		case tc.want == 0 && len(ws) != 0:
			t.Errorf("%d options: warnings %+v, want none", len(tc.opts), ws)
		case tc.want != 0 && (len(ws) != 1 || ws[0].Kind != tc.want):
			t.Errorf("%d options: warnings %+v, want %v", len(tc.opts), ws, tc.want)
		}
	}
}

func TestNewMessage(t *testing.T) {
	d := &amqp.Delivery{MessageId: "id-1", Body: []byte("b"), ContentType: "application/json", Redelivered: true,
		Headers: amqp.Table{HeaderBusinessKey: "order-9", HeaderVersion: "7", HeaderRetries: int64(2), "n": int32(5)}}
	m, err := newMessage(d, "work")
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "id-1" || m.BusinessKey != "order-9" || m.Version != 7 || m.Subject != "work" || m.Delivery != 4 || m.Headers["n"] != "5" {
		t.Errorf("message %+v", m)
	}
	// A quorum queue's count wins over the redelivered flag.
	d.Headers[HeaderDeliveryCount] = int64(3)
	if m, _ := newMessage(d, "work"); m.Delivery != 6 {
		t.Errorf("delivery %d, want 1+3+2", m.Delivery)
	}
	// The publishing of a message carries its envelope back.
	p := publishing(m)
	if p.MessageId != "id-1" || p.ContentType != "application/json" || p.Headers[HeaderBusinessKey] != "order-9" || p.Headers[HeaderDeliveryCount] != nil || p.Headers[HeaderRetries] != nil {
		t.Errorf("publishing %+v", p)
	}
	if _, err := newMessage(&amqp.Delivery{}, "q"); !errors.Is(err, ErrNoMessageID) {
		t.Errorf("no ID: %v", err)
	}
	var he *HeaderError
	if _, err := newMessage(&amqp.Delivery{MessageId: "x", Headers: amqp.Table{HeaderVersion: "v2"}}, "q"); !errors.As(err, &he) {
		t.Errorf("bad version: %v", err)
	}
	if _, err := newMessage(&amqp.Delivery{MessageId: "x", Headers: amqp.Table{HeaderRetries: "many"}}, "q"); !errors.As(err, &he) {
		t.Errorf("bad retries: %v", err)
	}
}
