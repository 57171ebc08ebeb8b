package dedupnats

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// waitLong bounds every wait for the broker: generous, because the test
// machine is slow and runs under -race. No test asserts how fast anything
// is; they wait for a state and fail only when it never comes.
const waitLong = 90 * time.Second

// rig is one test's world: a connection, a stream of its own, a
// publisher, a dead-letter stream and a memory dedup store.
type rig struct {
	t       *testing.T
	nc      *nats.Conn
	js      jetstream.JetStream
	stream  string
	subject string
	pub     *Publisher
	dlq     *DLQ
	store   *memstore.Store
	log     *slog.Logger
}

func newRig(t *testing.T, adjust ...func(*jetstream.StreamConfig)) *rig {
	t.Helper()
	nc, js := connect(t)
	r := &rig{t: t, nc: nc, js: js}
	r.stream = newStream(t, js, adjust...)
	r.subject = r.stream + ".events"
	var err error
	if r.pub, err = NewPublisher(js); err != nil {
		t.Fatal(err)
	}
	dlqName := uniqueName(t, "DLQ")
	if r.dlq, err = NewDLQ(ctxT(t), js, dlqName, WithMemoryStorage()); err != nil {
		t.Fatal(err)
	}
	deleteStreamOnCleanup(t, dlqName)
	if r.store, err = memstore.New(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.store.Close() })
	r.log = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelError}))
	return r
}

// ctxT returns a context bounded by waitLong and cancelled with the test.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	t.Cleanup(cancel)
	return ctx
}

// processor returns a processor on the rig's store and dead-letter
// stream with short backoffs.
func (r *rig) processor(name string, h consumer.Handler, opts ...consumer.Option) *consumer.Processor {
	r.t.Helper()
	base := []consumer.Option{consumer.WithDeadLetter(r.dlq), consumer.WithBackoff(20*time.Millisecond, 300*time.Millisecond)}
	p, err := consumer.New(name, r.store, h, append(base, opts...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	return p
}

// consumer returns a consumer of the rig's stream on js (the rig's own
// connection when nil).
func (r *rig) consumer(js jetstream.JetStream, durable string, p *consumer.Processor, opts ...ConsumerOption) *Consumer {
	r.t.Helper()
	if js == nil {
		js = r.js
	}
	base := []ConsumerOption{WithLogger(r.log), WithFetchWait(time.Second)}
	c, err := NewConsumer(js, r.stream, durable, p, append(base, opts...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	return c
}

// start runs c until the test ends; the channel gets Run's result.
func (r *rig) start(c *Consumer) <-chan error {
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	r.t.Cleanup(func() { c.Close() })
	return errc
}

// publish publishes a message with logical ID id through the Publisher.
func (r *rig) publish(id string, edit ...func(*consumer.Message)) (duplicate bool) {
	r.t.Helper()
	m := &consumer.Message{ID: id, Payload: []byte("body of " + id)}
	for _, f := range edit {
		f(m)
	}
	dup, err := r.pub.Publish(ctxT(r.t), r.subject, m)
	if err != nil {
		r.t.Fatalf("publish %s: %v", id, err)
	}
	return dup
}

// publishRaw publishes with exactly the given headers, as a producer that
// does not use the Publisher would.
func (r *rig) publishRaw(headers map[string]string, body string) *jetstream.PubAck {
	r.t.Helper()
	msg := nats.NewMsg(r.subject)
	for k, v := range headers {
		msg.Header.Set(k, v)
	}
	msg.Data = []byte(body)
	ack, err := r.js.PublishMsg(ctxT(r.t), msg)
	if err != nil {
		r.t.Fatalf("publish: %v", err)
	}
	return ack
}

func (r *rig) consumerInfo(durable string) *jetstream.ConsumerInfo {
	r.t.Helper()
	ci, err := r.js.Consumer(ctxT(r.t), r.stream, durable)
	if err != nil {
		r.t.Fatalf("consumer %s: %v", durable, err)
	}
	info, err := ci.Info(ctxT(r.t))
	if err != nil {
		r.t.Fatalf("consumer info %s: %v", durable, err)
	}
	return info
}

// settled waits until the durable consumer has nothing pending and
// nothing unacknowledged: every message was acknowledged or terminated.
func (r *rig) settled(durable string) *jetstream.ConsumerInfo {
	r.t.Helper()
	var info *jetstream.ConsumerInfo
	eventually(r.t, "every message acknowledged", func() bool {
		info = r.consumerInfo(durable)
		return info.NumPending == 0 && info.NumAckPending == 0
	})
	return info
}

func (r *rig) dlqCount() uint64 {
	r.t.Helper()
	n, err := r.dlq.Count(ctxT(r.t))
	if err != nil {
		r.t.Fatal(err)
	}
	return n
}

func (r *rig) streamMsgs() uint64 {
	r.t.Helper()
	s, err := r.js.Stream(ctxT(r.t), r.stream)
	if err != nil {
		r.t.Fatal(err)
	}
	return s.CachedInfo().State.Msgs
}

// eventually polls cond until it holds, failing the test after waitLong.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for: %s", waitLong, what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// waitRun waits for Run's result.
func waitRun(t *testing.T, errc <-chan error) error {
	t.Helper()
	select {
	case err := <-errc:
		return err
	case <-time.After(waitLong):
		t.Fatal("Run did not return")
		return nil
	}
}

// effects counts effects per logical ID: the property every test checks.
type effects struct {
	mu sync.Mutex
	n  map[string]int
}

func (e *effects) add(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.n == nil {
		e.n = map[string]int{}
	}
	e.n[id]++
}

func (e *effects) get(id string) int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.n[id]
}

func (e *effects) snapshot() map[string]int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return maps.Clone(e.n)
}

// all reports whether every id has at least one effect.
func (e *effects) all(ids []string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, id := range ids {
		if e.n[id] == 0 {
			return false
		}
	}
	return true
}

// exactlyOnce fails the test for any id without exactly one effect, and
// for any effect of an id not in ids.
func (e *effects) exactlyOnce(t *testing.T, ids []string) {
	t.Helper()
	got := e.snapshot()
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("%s applied %d times, want exactly once", id, got[id])
		}
		delete(got, id)
	}
	for id, n := range got {
		t.Errorf("unexpected effect: %s applied %d times", id, n)
	}
}

// decisions records the processor's decisions per message ID.
type decisions struct {
	mu sync.Mutex
	m  map[string][]consumer.Decision
}

func (d *decisions) observe(m *consumer.Message, dec consumer.Decision) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.m == nil {
		d.m = map[string][]consumer.Decision{}
	}
	d.m[m.ID] = append(d.m[m.ID], dec)
}

func (d *decisions) of(id string) []consumer.Decision {
	d.mu.Lock()
	defer d.mu.Unlock()
	return append([]consumer.Decision(nil), d.m[id]...)
}

func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + "-" + string(rune('a'+i/26)) + string(rune('a'+i%26))
	}
	return out
}

var errBroken = errors.New("handler is broken for this message")
