package dedupwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/dedupwatermill"
	"github.com/dedupkit/dedup/memstore"
	"github.com/dedupkit/dedup/outbox"
	"github.com/dedupkit/dedup/sqlitestore"
)

// lossyPublisher fails its first fails calls before sending, and after
// that loses the acknowledgement of every lossEvery-th call: the message
// was published but the caller gets an error (the relay sends it again
// under the same ID).
type lossyPublisher struct {
	message.Publisher
	fails     atomic.Int64
	lossEvery int64
	calls     atomic.Int64
	lost      atomic.Int64
}

func (p *lossyPublisher) Publish(topic string, msgs ...*message.Message) error {
	n := p.calls.Add(1)
	if p.fails.Add(-1) >= 0 {
		return errBrokerDown
	}
	if err := p.Publisher.Publish(topic, msgs...); err != nil {
		return err
	}
	if n%p.lossEvery == 0 {
		p.lost.Add(1)
		return errors.New("ack lost")
	}
	return nil
}

// The relay publishes an SQLite outbox through a Watermill publisher that
// fails and loses acknowledgements; a router with the middleware keyed on
// the stable message ID applies every committed event once, in order per
// aggregate, and never one that was rolled back.
func TestRelayThroughWatermill(t *testing.T) {
	const n, aggregates = 200, 5
	db, err := sqlitestore.Open(filepath.Join(t.TempDir(), "outbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	ctx := context.Background()
	src, err := db.OutboxSource(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	write := func(commit bool, msgs ...outbox.Message) {
		tx, err := db.DB().BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		if err := db.WriteOutbox(ctx, tx, msgs...); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range n {
		write(true, outbox.Message{ID: fmt.Sprint("evt-", i), Topic: "orders", Key: fmt.Sprint("agg-", i%aggregates),
			Payload: []byte(strconv.Itoa(i)), Headers: map[string]string{"traceparent": "00-1-2-01"}})
	}
	write(false, outbox.Message{ID: "rolled-back", Topic: "orders", Key: "agg-0", Payload: []byte("-1")})

	// The consumer.
	store, _ := memstore.New()
	mw := newMiddleware(t, store, dedupwatermill.WithMetadataKey(dedupwatermill.MetadataMessageID))
	// Publish returns once the subscriber acked: gochannel otherwise
	// delivers each message from a goroutine of its own, out of order.
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { ps.Close() })
	r := newRouter(t)
	var mu sync.Mutex
	applied := map[string]int{}
	last := map[string]int{}
	var disorder, badMeta []string
	r.AddNoPublisherHandler("apply", "orders", ps, func(m *message.Message) error {
		mu.Lock()
		defer mu.Unlock()
		id := m.Metadata.Get(dedupwatermill.MetadataMessageID)
		agg := m.Metadata.Get(dedupwatermill.MetadataAggregate)
		if m.UUID != id || m.Metadata.Get("traceparent") != "00-1-2-01" {
			badMeta = append(badMeta, m.UUID)
		}
		seq, _ := strconv.Atoi(string(m.Payload))
		if prev, ok := last[agg]; ok && seq <= prev {
			disorder = append(disorder, fmt.Sprint(agg, ": ", seq, " after ", prev))
		}
		last[agg] = seq
		applied[id]++
		return nil
	})
	r.AddMiddleware(mw.Middleware)
	startRouter(t, r)

	// The relay.
	pub := &lossyPublisher{Publisher: ps, lossEvery: 9}
	pub.fails.Store(3)
	op, err := dedupwatermill.NewOutboxPublisher(pub)
	if err != nil {
		t.Fatal(err)
	}
	rl, err := outbox.NewRelay(src, op, outbox.WithLeaseTTL(time.Second), outbox.WithPollInterval(5*time.Millisecond),
		outbox.WithBackoff(time.Millisecond, 5*time.Millisecond), outbox.WithBatchSize(16))
	if err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() { errc <- rl.Run(ctx) }()
	t.Cleanup(func() {
		rl.Close()
		if err := <-errc; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	waitFor(t, "every event applied", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(applied) >= n
	})
	waitFor(t, "the duplicates acked", func() bool { return mw.Stats().Duplicates >= uint64(pub.lost.Load()) })
	mu.Lock()
	defer mu.Unlock()
	for i := range n {
		if c := applied[fmt.Sprint("evt-", i)]; c != 1 {
			t.Errorf("evt-%d applied %d times", i, c)
		}
	}
	if applied["rolled-back"] != 0 || len(applied) != n {
		t.Errorf("%d distinct events applied (rolled back: %d), want %d", len(applied), applied["rolled-back"], n)
	}
	if len(disorder) > 0 || len(badMeta) > 0 {
		t.Errorf("out of order: %v; bad metadata: %v", disorder, badMeta)
	}
	if pub.lost.Load() == 0 || mw.Stats().Duplicates == 0 {
		t.Errorf("no lost acknowledgement was exercised (lost %d, duplicates %d)", pub.lost.Load(), mw.Stats().Duplicates)
	}
}

// Publish stops a batch at the first failure (later messages not sent),
// reports a cancelled context as not sent, and marks the errors the
// filter names permanent.
func TestOutboxPublisherBatch(t *testing.T) {
	ps := newPubSub(t)
	got := collect(t, ps, "t")
	tooBig := errors.New("too big")
	pub := &flakyPublisher{Publisher: ps}
	op, err := dedupwatermill.NewOutboxPublisher(&sizeLimited{Publisher: pub, limit: 4, err: tooBig},
		dedupwatermill.WithPermanentErrors(func(err error) bool { return errors.Is(err, tooBig) }))
	if err != nil {
		t.Fatal(err)
	}
	batch := []outbox.Message{
		{ID: "a", Topic: "t", Payload: []byte("1")},
		{ID: "b", Topic: "t", Payload: []byte("12345")},
		{ID: "c", Topic: "t", Payload: []byte("1")},
	}
	res := make([]error, 3)
	op.Publish(context.Background(), batch, res)
	if res[0] != nil || !outbox.IsPermanent(res[1]) || !errors.Is(res[2], outbox.ErrNotSent) {
		t.Fatalf("results %v", res)
	}
	waitFor(t, "a", func() bool { return got.count("a") == 1 })
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	res = make([]error, 1)
	op.Publish(cctx, batch[:1], res)
	if !errors.Is(res[0], outbox.ErrNotSent) {
		t.Fatalf("cancelled: %v", res)
	}
	pub.fails.Store(1)
	res = make([]error, 2)
	op.Publish(context.Background(), batch[2:], res[:1])
	if !errors.Is(res[0], errBrokerDown) || outbox.IsPermanent(res[0]) {
		t.Fatalf("transient failure: %v", res[0])
	}
	if _, err := dedupwatermill.NewOutboxPublisher(nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatal(err)
	}
}

type sizeLimited struct {
	message.Publisher
	limit int
	err   error
}

func (s *sizeLimited) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		if len(m.Payload) > s.limit {
			return s.err
		}
	}
	return s.Publisher.Publish(topic, msgs...)
}
