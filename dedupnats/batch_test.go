package dedupnats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/nats-io/nats.go/jetstream"
)

// batchCounter counts the batch calls a store gets.
type batchCounter struct {
	*memstore.Store
	claims, completes, claimed atomic.Int64
}

func (s *batchCounter) ClaimBatch(ctx context.Context, reqs []dedup.ClaimRequest, lease time.Duration) ([]dedup.Claim, error) {
	s.claims.Add(1)
	s.claimed.Add(int64(len(reqs)))
	return s.Store.ClaimBatch(ctx, reqs, lease)
}

func (s *batchCounter) CompleteBatch(ctx context.Context, items []dedup.Completion, ret time.Duration) ([]error, error) {
	s.completes.Add(1)
	return s.Store.CompleteBatch(ctx, items, ret)
}

// TestBatchProcessingOneEffectEach: a batch consumer over a stream with
// consumer-level duplicates, a poison message, a transient failure and a
// malformed envelope applies every message once, dead-letters the poison
// (after its attempts) and the malformed one, and retries the transient
// failure, all through batch claims and completes.
func TestBatchProcessingOneEffectEach(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	store := &batchCounter{Store: r.store}
	var eff effects
	var poisonRuns, flakyRuns atomic.Int64
	p, err := consumer.New("batch", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		switch m.ID {
		case "poison":
			poisonRuns.Add(1)
			return nil, consumer.Permanent(errors.New("payload does not parse"))
		case "flaky":
			if flakyRuns.Add(1) == 1 {
				return nil, consumer.Transient(errors.New("connection refused"))
			}
		}
		eff.add(m.ID)
		return []byte("ok"), nil
	}, consumer.WithDeadLetter(r.dlq), consumer.WithBackoff(20*time.Millisecond, 300*time.Millisecond),
		consumer.WithLimits(consumer.Limits{Permanent: 3}))
	if err != nil {
		t.Fatal(err)
	}
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithBatchProcessing(), WithBatch(16))

	want := ids("m", 40)
	for i, id := range want {
		r.publish(id)
		if i%4 == 0 { // the same logical ID again, under another broker ID
			r.publishRaw(map[string]string{HeaderMsgID: id, jetstream.MsgIDHeader: fmt.Sprint("again-", i)}, "again")
		}
		switch i {
		case 5:
			r.publish("poison", func(m *consumer.Message) { m.BusinessKey = "order-66" })
		case 17:
			r.publish("flaky")
		case 30:
			r.publishRaw(map[string]string{HeaderMsgID: "bad-v", HeaderVersion: "v7"}, "x")
		}
	}
	r.start(c)
	eventually(t, "every message applied and both dead letters kept", func() bool {
		return eff.all(append(want, "flaky")) && r.dlqCount() == 2
	})
	info := r.settled(durable)

	eff.exactlyOnce(t, append(want, "flaky"))
	if n := poisonRuns.Load(); n != 3 {
		t.Errorf("poison ran %d times, want its 3 attempts", n)
	}
	recs, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil || len(recs) != 2 {
		t.Fatalf("dead letters %+v, %v", recs, err)
	}
	byID := map[string]consumer.DeadLetter{}
	for _, dl := range recs {
		byID[dl.Message.ID] = dl
	}
	if dl := byID["poison"]; dl.Class != consumer.ClassPermanent || dl.Attempts != 3 || dl.Message.BusinessKey != "order-66" ||
		!strings.Contains(dl.Reason, "payload does not parse") || dl.Consumer != "batch" {
		t.Errorf("poison dead letter %+v", dl)
	}
	if dl := byID["bad-v"]; dl.Class != consumer.ClassPermanent || !strings.Contains(dl.Reason, HeaderVersion) {
		t.Errorf("malformed dead letter %+v", dl)
	}
	s, cs := p.Stats(), c.Stats()
	if s.Applied != 41 || s.Duplicates != 10 || s.DeadLettered != 2 || s.StoreErrors != 0 {
		t.Errorf("processor stats %+v, want 41 applied, 10 duplicates, 2 dead letters", s)
	}
	if cs.Acked != 51 || cs.Terminated != 2 || cs.EnvelopeErrors != 1 || cs.Naked != s.Retries {
		t.Errorf("consumer stats %+v (processor %+v), want 51 acked, 2 terminated, a Nak per retry", cs, s)
	}
	if info.Delivered.Consumer != 53+s.Retries {
		t.Errorf("broker delivered %d times for 53 messages and %d retries", info.Delivered.Consumer, s.Retries)
	}
	// Batches, not messages one by one.
	claims, claimed := store.claims.Load(), store.claimed.Load()
	if claims == 0 || store.completes.Load() == 0 || claimed < 2*claims {
		t.Errorf("%d batch claims of %d keys, %d batch completes: want batches of more than one message on average",
			claims, claimed, store.completes.Load())
	}
	t.Logf("%d batch claims of %d keys in all", claims, claimed)
}

// TestBatchProcessingKeepsHeldMessagesAlive: a batch whose handlers take
// longer than AckWait in all is not redelivered: every message of it,
// waiting or running, gets InProgress until it is settled.
func TestBatchProcessingKeepsHeldMessagesAlive(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var calls atomic.Int64
	p := r.processor("slow", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		select {
		case <-time.After(600 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return nil, nil
	})
	durable := uniqueName(t, "C")
	want := ids("s", 5)
	for _, id := range want {
		r.publish(id)
	}
	// Wait for the whole backlog to be fetched at once: one batch of 5
	// handlers takes 3 s, three times AckWait.
	c := r.consumer(nil, durable, p, WithBatchProcessing(), WithAckWait(time.Second))
	r.start(c)
	eventually(t, "applied", func() bool { return p.Stats().Applied == 5 })
	info := r.settled(durable)
	if n := calls.Load(); n != 5 {
		t.Errorf("handlers ran %d times, want 5", n)
	}
	if info.Delivered.Consumer != 5 {
		t.Errorf("broker delivered %d times, want 5 (no redelivery)", info.Delivered.Consumer)
	}
	if s := c.Stats(); s.InProgress == 0 || s.Acked != 5 {
		t.Errorf("consumer stats %+v, want InProgress heartbeats and 5 Acks", s)
	}
}

func TestBatchProcessingNeedsConcurrencyOne(t *testing.T) {
	s, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	p, err := consumer.New("c", s, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	var js jetstream.JetStream = fakeJS{}
	if _, err := NewConsumer(js, "S", "D", p, WithBatchProcessing(), WithConcurrency(4)); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Fatalf("batch processing with concurrency 4: %v, want an invalid-argument error", err)
	}
	if _, err := NewConsumer(js, "S", "D", p, WithBatchProcessing()); err != nil {
		t.Fatalf("batch processing: %v", err)
	}
}
