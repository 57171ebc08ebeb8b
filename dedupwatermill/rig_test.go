package dedupwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/internal/testenv"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/pgstore"
	"github.com/dedupkit/dedup/redisstore"
	"github.com/dedupkit/dedup/storetest"
	"github.com/redis/rueidis"
)

// engines are the stores the router tests run on: memory (with a manual
// clock) and the real Redis and PostgreSQL servers.
type engine struct {
	name string
	// open returns a store; a second call with the same t opens another
	// handle on the same data (a restarted process).
	open func(t *testing.T) func() dedup.Store
}

var engines = []engine{
	{"memstore", func(t *testing.T) func() dedup.Store {
		s, err := memstore.New()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		return func() dedup.Store { return s }
	}},
	{"redis", func(t *testing.T) func() dedup.Store {
		addrs := testenv.Addrs(t, "DEDUP_REDIS_ADDR", "127.0.0.1:6379", "Redis")
		prefix := fmt.Sprintf("dedupwatermill-test-%x:", rand.Uint64())
		return func() dedup.Store {
			s, err := redisstore.Open(rueidis.ClientOption{InitAddress: addrs}, redisstore.WithPrefix(prefix))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s
		}
	}},
	{"postgres", func(t *testing.T) func() dedup.Store {
		pool := testenv.PostgresPool(t)
		schema := testenv.PostgresSchema(t, pool)
		return func() dedup.Store {
			s, err := pgstore.New(pool, pgstore.WithSchema(schema))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			if _, err := s.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			return s
		}
	}},
}

// newMiddleware returns a middleware closed at the end of the test.
func newMiddleware(t *testing.T, s dedup.Store, opts ...dedupwatermill.Option) *dedupwatermill.Middleware {
	t.Helper()
	mw, err := dedupwatermill.New(s, "orders", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mw.Close() })
	return mw
}

// newPubSub returns a gochannel pub/sub closed at the end of the test.
func newPubSub(t *testing.T) *gochannel.GoChannel {
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, watermill.NopLogger{})
	t.Cleanup(func() { ps.Close() })
	return ps
}

// startRouter runs r until the test ends (or until the returned stop is
// called).
func startRouter(t *testing.T, r *message.Router) (stop func()) {
	t.Helper()
	errc := make(chan error, 1)
	go func() { errc <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
	case err := <-errc:
		t.Fatalf("router: %v", err)
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			if err := r.Close(); err != nil {
				t.Errorf("router close: %v", err)
			}
			if err := <-errc; err != nil {
				t.Errorf("router run: %v", err)
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func newRouter(t *testing.T) *message.Router {
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// waitFor polls cond until it holds; it fails the test after a generous
// bound (a hang, not a timing assertion).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// flakyPublisher fails its first fails publishes (before sending), then
// publishes through pub.
type flakyPublisher struct {
	message.Publisher
	fails atomic.Int64
	calls atomic.Int64
}

var errBrokerDown = errors.New("broker down")

func (f *flakyPublisher) Publish(topic string, msgs ...*message.Message) error {
	f.calls.Add(1)
	if f.fails.Add(-1) >= 0 {
		return errBrokerDown
	}
	return f.Publisher.Publish(topic, msgs...)
}

// collect subscribes to topic and counts the messages by UUID.
type collector struct {
	mu   sync.Mutex
	seen map[string]int
	n    atomic.Int64
}

func collect(t *testing.T, sub message.Subscriber, topic string) *collector {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ch, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatal(err)
	}
	c := &collector{seen: map[string]int{}}
	go func() {
		for m := range ch {
			c.mu.Lock()
			c.seen[m.UUID]++
			c.mu.Unlock()
			c.n.Add(1)
			m.Ack()
		}
	}()
	return c
}

func (c *collector) count(uuid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.seen[uuid]
}

var _ = storetest.NewClock
