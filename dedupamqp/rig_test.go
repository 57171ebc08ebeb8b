package dedupamqp

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"log/slog"
	"net/url"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	amqp "github.com/rabbitmq/amqp091-go"
)

// waitLong bounds every wait for the broker: generous, because the
// machine is shared and the tests run under -race. No test asserts how
// fast anything is; they wait for a state and fail only if it never
// comes.
const waitLong = 90 * time.Second

// rig is one test's world: a queue of its own, a publisher, a
// dead-letter exchange and queue, a memory dedup store and an effect
// ledger.
type rig struct {
	t     *testing.T
	url   string
	queue string
	pub   *Publisher
	dlq   *DLQ
	store *memstore.Store
	log   *slog.Logger

	mu      sync.Mutex
	effects map[string]int
}

func unique(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

func newRig(t *testing.T) *rig { return newRigAt(t, testenv.AMQPURL(t)) }

func newRigAt(t *testing.T, url string) *rig {
	t.Helper()
	r := &rig{t: t, url: url, queue: unique("dedupamqp-test"), effects: map[string]int{}}
	var err error
	if r.pub, err = NewPublisher(url); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.pub.Close() })
	if r.dlq, err = NewDLQ(ctxT(t), url, r.queue+".dlx", "test"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.dlq.Close() })
	if r.store, err = memstore.New(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.store.Close() })
	r.log = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: testLogLevel}))
	t.Cleanup(func() { r.cleanup() })
	return r
}

// cleanup deletes the queues and the exchange the test made.
func (r *rig) cleanup() {
	conn, err := amqp.Dial(r.url)
	if err != nil {
		return
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	defer ch.Close()
	for _, q := range []string{r.queue, r.queue + ".dlx"} {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	for _, d := range []time.Duration{50 * time.Millisecond, 200 * time.Millisecond, 250 * time.Millisecond, time.Second, 5 * time.Second, 30 * time.Second} {
		_, _ = ch.QueueDelete(r.queue+".retry."+d.String(), false, false, false)
	}
	_ = ch.ExchangeDelete(r.queue+".dlx", false, false)
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), waitLong)
	t.Cleanup(cancel)
	return ctx
}

// effect records one application of id.
func (r *rig) effect(id string) {
	r.mu.Lock()
	r.effects[id]++
	r.mu.Unlock()
}

func (r *rig) effectsOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.effects[id]
}

func (r *rig) applied() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.effects)
}

// checkOnce fails the test for any id applied other than once.
func (r *rig) checkOnce(ids []string) {
	r.t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, id := range ids {
		if n := r.effects[id]; n != 1 {
			r.t.Errorf("message %s applied %d times, want 1", id, n)
		}
	}
}

// processor returns a processor on the rig's store and dead-letter queue
// with short backoffs.
func (r *rig) processor(name string, h consumer.Handler, opts ...consumer.Option) *consumer.Processor {
	r.t.Helper()
	base := []consumer.Option{consumer.WithDeadLetter(r.dlq), consumer.WithBackoff(20*time.Millisecond, 50*time.Millisecond), consumer.WithLogger(r.log)}
	p, err := consumer.New(name, r.store, h, append(base, opts...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	return p
}

// consumer returns a consumer of the rig's queue with short retry delays
// and reconnect backoff, dead-lettering to the rig's exchange.
func (r *rig) consumer(p *consumer.Processor, opts ...ConsumerOption) *Consumer {
	r.t.Helper()
	base := []ConsumerOption{WithRetryDelays(50 * time.Millisecond), WithReconnectBackoff(50*time.Millisecond, 500*time.Millisecond),
		WithLogger(r.log), WithDeadLetterExchange(r.dlq.Exchange())}
	c, err := NewConsumer(r.url, r.queue, p, append(base, opts...)...)
	if err != nil {
		r.t.Fatal(err)
	}
	return c
}

// run starts c and stops it at the end of the test, failing on an error.
func (r *rig) run(c *Consumer) {
	r.t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- c.Run(context.Background()) }()
	r.t.Cleanup(func() {
		c.Close()
		if err := <-errc; err != nil {
			r.t.Errorf("Run: %v", err)
		}
	})
}

// publish sends messages id-0 .. id-(n-1) to the rig's queue; the queue
// must exist (run a consumer first, or declare).
func (r *rig) publish(prefix string, n int) []string {
	r.t.Helper()
	ids := make([]string, n)
	for i := range n {
		ids[i] = prefix + "-" + itoa(i)
		m := &consumer.Message{ID: ids[i], Payload: []byte("payload " + ids[i]), Headers: map[string]string{"X-Trace": "t-" + ids[i]}}
		if err := r.pub.Publish(ctxT(r.t), r.queue, m); err != nil {
			r.t.Fatal(err)
		}
	}
	return ids
}

func itoa(i int) string { return strconv.Itoa(i) }

// declare declares the rig's work queue as c would, so messages can be
// published before c runs.
func (r *rig) declare(c *Consumer) {
	r.t.Helper()
	conn, err := amqp.Dial(r.url)
	if err != nil {
		r.t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		r.t.Fatal(err)
	}
	defer ch.Close()
	if err := c.declare(ch); err != nil {
		r.t.Fatal(err)
	}
}

// waitFor polls cond until it holds, failing after waitLong.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitLong)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// privateVhost makes a vhost of the test's own (so dropping its
// connections from the server touches no other test) and returns the URL
// of base on it.
func privateVhost(t *testing.T, base string) (string, string) {
	t.Helper()
	if _, err := exec.LookPath("rabbitmqctl"); err != nil {
		t.Skip("rabbitmqctl not found: needed to drop connections from the server side")
	}
	vhost := unique("dedupamqp-vh")
	ctl := func(args ...string) error {
		out, err := exec.Command("rabbitmqctl", args...).CombinedOutput()
		if err != nil {
			t.Logf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return err
	}
	if err := ctl("add_vhost", vhost); err != nil {
		t.Skip("rabbitmqctl cannot manage this server (run the tests as root or the rabbitmq user)")
	}
	t.Cleanup(func() { _ = ctl("delete_vhost", vhost) })
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	user := "guest"
	if u.User != nil && u.User.Username() != "" {
		user = u.User.Username()
	}
	if err := ctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*"); err != nil {
		t.Fatal("cannot grant permissions on the test vhost")
	}
	u.Path = "/" + vhost
	return u.String(), vhost
}

// closeAll closes every connection of vhost from the server side.
func closeAll(t *testing.T, vhost string) {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", "close_all_connections", "-p", vhost, "dedupamqp test drop").CombinedOutput()
	if err != nil {
		t.Fatalf("rabbitmqctl close_all_connections: %v\n%s", err, out)
	}
}

var testLogLevel = slog.LevelError
