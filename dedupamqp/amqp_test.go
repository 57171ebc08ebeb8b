package dedupamqp

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	amqp "github.com/rabbitmq/amqp091-go"
)

// applyOnce is a handler that records one effect per call.
func (r *rig) applyOnce() consumer.Handler {
	return func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		r.effect(m.ID)
		return nil, nil
	}
}

func TestConsumerAppliesEachOnceAndAcksDuplicates(t *testing.T) {
	r := newRig(t)
	p := r.processor("plain", r.applyOnce())
	c := r.consumer(p, WithConcurrency(4), WithPrefetch(16))
	r.declare(c)
	ids := r.publish("m", 50)
	r.publish("m", 10) // the same IDs again: producer retries
	r.run(c)
	waitFor(t, "every copy settled", func() bool { return c.Stats().Acked == 60 })
	r.checkOnce(ids)
	if s := p.Stats(); s.Duplicates != 10 {
		t.Errorf("processor counted %d duplicates, want 10", s.Duplicates)
	}
}

// Batch mode: the waiting deliveries are claimed and completed together,
// each acked alone after its decision; duplicates inside and across
// batches are acked without a second effect, and a poison message in a
// batch is dead-lettered while the rest of it applies.
func TestBatchAppliesEachOnce(t *testing.T) {
	r := newRig(t)
	p := r.processor("batch", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "b-7" {
			return nil, consumer.Permanent(errors.New("cannot parse"))
		}
		r.effect(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Permanent: 1}))
	c := r.consumer(p, WithPrefetch(64), WithBatch(32), WithConcurrency(2))
	r.declare(c)
	ids := r.publish("b", 200)
	r.publish("b", 60) // the same IDs again: producer retries
	r.run(c)
	waitFor(t, "every copy settled", func() bool { return c.Stats().Acked == 260 })
	var good []string
	for _, id := range ids {
		if id != "b-7" {
			good = append(good, id)
		}
	}
	r.checkOnce(good)
	if r.effectsOf("b-7") != 0 {
		t.Error("the poison message took effect")
	}
	if st := c.Stats(); st.DeadLettered < 1 || st.Batches == 0 || st.Batched <= st.Batches {
		t.Errorf("poison message not dead-lettered, or no batch of more than one ran: %+v", st)
	}
	if s := p.Stats(); s.Duplicates < 59 {
		t.Errorf("processor counted %d duplicates, want at least 59 (60 re-sends, one of them of the poison message)", s.Duplicates)
	}
}

// A consumer killed after the commit and before the ack: the broker
// returns the message when the connection dies, and the redelivery is a
// duplicate, acked without a second effect.
func TestKilledAfterCommitBeforeAck(t *testing.T) {
	r := newRig(t)
	p := r.processor("after-commit", r.applyOnce())
	c := r.consumer(p)
	var killed atomic.Bool
	c.process = func(ctx context.Context, s *session, d *amqp.Delivery) {
		m, err := newMessage(d, c.queue)
		if err != nil {
			t.Error(err)
			return
		}
		dec := p.Process(ctx, m)
		if m.ID == "k-3" && killed.CompareAndSwap(false, true) {
			// Committed; die before the ack.
			s.conn.Close()
			return
		}
		c.settle(ctx, s, d, m, dec)
	}
	r.declare(c)
	ids := r.publish("k", 8)
	r.run(c)
	t.Cleanup(func() { t.Logf("stats %+v processor %+v effects %v", c.Stats(), p.Stats(), r.effects) })
	waitFor(t, "every message applied and the redelivery absorbed", func() bool {
		return r.applied() == 8 && p.Stats().Duplicates >= 1 && c.Stats().Acked >= 8 && queueDepth(t, r) == 0
	})
	r.checkOnce(ids)
	st := c.Stats()
	if st.Sessions < 2 {
		t.Errorf("sessions = %d, want a reconnection", st.Sessions)
	}
	if p.Stats().Duplicates < 1 {
		t.Errorf("the redelivery of k-3 was not seen as a duplicate: %+v", p.Stats())
	}
	if st.PreconditionFailed != 0 {
		t.Errorf("PRECONDITION_FAILED on %d channels", st.PreconditionFailed)
	}
}

// A consumer killed before the commit: nothing was applied, the broker
// returns the message, the redelivery applies it once.
func TestKilledBeforeCommit(t *testing.T) {
	r := newRig(t)
	var (
		c      *Consumer
		killed atomic.Bool
		calls  atomic.Int32
	)
	p := r.processor("before-commit", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		if m.ID == "b-2" && killed.CompareAndSwap(false, true) {
			c.conn().Close() // the process dies mid-handler
			return nil, consumer.Transient(errors.New("killed"))
		}
		r.effect(m.ID)
		return nil, nil
	})
	c = r.consumer(p)
	r.declare(c)
	ids := r.publish("b", 6)
	r.run(c)
	waitFor(t, "every message applied", func() bool { return r.applied() == 6 && c.Stats().Acked == 6 })
	r.checkOnce(ids)
	if calls.Load() < 7 {
		t.Errorf("handler ran %d times, want at least 7 (b-2 twice)", calls.Load())
	}
	if st := c.Stats(); st.Stale < 1 || st.PreconditionFailed != 0 {
		t.Errorf("stats %+v: want the dead session's decision dropped, no PRECONDITION_FAILED", st)
	}
}

// The server closes the connection mid-run, twice: the consumer
// reconnects, no delivery tag of the old channel is used on the new one,
// and every message is applied once.
func TestServerClosesConnectionMidRun(t *testing.T) {
	base := newRig(t) // checks the server and gives the base URL
	url, vhost := privateVhost(t, base.url)
	r := newRigAt(t, url)
	// Two messages hold their handler, after the effect, until the
	// server has dropped the connection: their decisions reach a dead
	// channel, and their redeliveries must be absorbed.
	gates := map[string]chan struct{}{"d-100": make(chan struct{}), "d-250": make(chan struct{})}
	p := r.processor("drop", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		r.effect(m.ID)
		if g := gates[m.ID]; g != nil && d.Attempt == 1 && m.Delivery == 1 {
			select {
			case <-g:
			case <-ctx.Done():
			}
		}
		return nil, nil
	})
	c := r.consumer(p, WithConcurrency(4), WithPrefetch(32))
	r.declare(c)
	ids := r.publish("d", 400)
	r.run(c)
	for i, id := range []string{"d-100", "d-250"} {
		waitFor(t, id+" held", func() bool { return r.effectsOf(id) == 1 })
		closeAll(t, vhost)
		waitFor(t, "a reconnection", func() bool { return c.Stats().Sessions >= uint64(i+2) })
		close(gates[id])
	}
	waitFor(t, "every message applied", func() bool { return r.applied() == 400 })
	waitFor(t, "the held messages' redeliveries absorbed", func() bool { return p.Stats().Duplicates >= 2 })
	waitFor(t, "the queue drained", func() bool { return queueDepth(t, r) == 0 })
	r.checkOnce(ids)
	st := c.Stats()
	if st.Sessions < 3 {
		t.Errorf("sessions = %d, want 3 (two drops)", st.Sessions)
	}
	if st.PreconditionFailed != 0 {
		t.Errorf("PRECONDITION_FAILED on %d channels: a delivery tag was misused", st.PreconditionFailed)
	}
	if st.Stale < 2 {
		t.Errorf("stale decisions = %d, want the two held ones dropped", st.Stale)
	}
	t.Logf("stats %+v, processor %+v", st, p.Stats())
}

// queueDepth returns the ready messages of the rig's queue.
func queueDepth(t *testing.T, r *rig) int {
	conn, err := amqp.Dial(r.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	q, err := ch.QueueDeclarePassive(r.queue, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}

// A poison message goes to the dead-letter exchange with its original
// message_id and headers and the failure, while the rest flow.
func TestPoisonDeadLetteredWhileRestFlow(t *testing.T) {
	r := newRig(t)
	p := r.processor("poison", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "p-4" {
			return nil, consumer.Permanent(errors.New("schema v9 unknown"))
		}
		r.effect(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Permanent: 2}))
	c := r.consumer(p)
	r.declare(c)
	ids := r.publish("p", 10)
	r.run(c)
	waitFor(t, "the rest applied", func() bool { return r.applied() == 9 })
	waitFor(t, "the poison message dead-lettered", func() bool { return c.Stats().DeadLettered == 1 })
	for _, id := range ids {
		if id == "p-4" {
			if r.effectsOf(id) != 0 {
				t.Error("poison message applied")
			}
			continue
		}
		if r.effectsOf(id) != 1 {
			t.Errorf("%s applied %d times", id, r.effectsOf(id))
		}
	}
	recs, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 1 {
		t.Fatalf("%d dead letters, want 1", len(recs))
	}
	dl := recs[0]
	if dl.Message.ID != "p-4" || dl.Message.Headers["X-Trace"] != "t-p-4" || string(dl.Message.Payload) != "payload p-4" {
		t.Errorf("dead letter lost the original: %+v", dl.Message)
	}
	if dl.Class != consumer.ClassPermanent || dl.Attempts != 2 || dl.Reason != "schema v9 unknown" || dl.Consumer != "poison" || dl.Key.ID != "p-4" {
		t.Errorf("dead letter metadata: %+v", dl)
	}
	if dl.Message.Subject != r.queue {
		t.Errorf("dead letter subject %q, want the queue %q", dl.Message.Subject, r.queue)
	}
	if st := c.Stats(); st.Retried != 1 {
		t.Errorf("retried %d times through the retry queue, want 1 (2 attempts)", st.Retried)
	}
}

// A Retry goes through the retry queue: the message comes back with
// Dedup-Retries one higher and its delivery count counted, and is then
// applied once.
func TestRetryQueueRedelivers(t *testing.T) {
	r := newRig(t)
	var mu sync.Mutex
	var seen []consumer.Message
	p := r.processor("retry", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		mu.Lock()
		seen = append(seen, m.Clone())
		n := len(seen)
		mu.Unlock()
		if n == 1 {
			return nil, consumer.Transient(errors.New("try later"))
		}
		r.effect(m.ID)
		return nil, nil
	})
	c := r.consumer(p, WithRetryDelays(200*time.Millisecond))
	r.declare(c)
	ids := r.publish("r", 1)
	r.run(c)
	waitFor(t, "applied", func() bool { return r.applied() == 1 && c.Stats().Acked == 1 })
	r.checkOnce(ids)
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 {
		t.Fatalf("handler saw %d deliveries, want 2", len(seen))
	}
	if seen[0].Delivery != 1 || seen[1].Delivery != 2 || seen[1].Headers[HeaderRetries] != "1" {
		t.Errorf("deliveries %d then %d (retries header %q), want 1 then 2 (1)", seen[0].Delivery, seen[1].Delivery, seen[1].Headers[HeaderRetries])
	}
	if seen[1].ID != "r-0" || seen[1].Headers["X-Trace"] != "t-r-0" {
		t.Errorf("retry copy lost its ID or headers: %+v", seen[1])
	}
	if st := c.Stats(); st.Retried != 1 || st.Requeued != 0 {
		t.Errorf("stats %+v: want one retry through the queue, no requeue", st)
	}
	if c.RetryQueue(50*time.Millisecond) != r.queue+".retry.200ms" || c.RetryQueue(time.Hour) != r.queue+".retry.200ms" {
		t.Errorf("retry queue rounding: %s", c.RetryQueue(50*time.Millisecond))
	}
}

// A quorum queue past its delivery limit dead-letters to the exchange
// instead of dropping: the broker's own dead letter is a record of the
// DLQ, with its message ID and the key under the DLQ's scope.
func TestQuorumDeliveryLimitDeadLetters(t *testing.T) {
	r := newRig(t)
	var c *Consumer
	var kills atomic.Int32
	p := r.processor("quorum", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "q-1" {
			kills.Add(1)
			c.conn().Close() // crashes its consumer every time
			return nil, consumer.Transient(errors.New("killed"))
		}
		r.effect(m.ID)
		return nil, nil
	})
	// Prefetch 1: a crash returns every message the channel held, and
	// each return counts towards that message's delivery limit.
	c = r.consumer(p, WithQueueType(Quorum), WithDeliveryLimit(2), WithPrefetch(1))
	if len(c.Warnings()) != 0 {
		t.Errorf("warnings with a dead-letter exchange: %+v", c.Warnings())
	}
	r.declare(c)
	ids := r.publish("q", 3)
	r.run(c)
	var recs []consumer.DeadLetter
	waitFor(t, "the broker's dead letter", func() bool {
		var err error
		recs, err = r.dlq.List(ctxT(t), "", 0)
		if len(recs) > 1 {
			for _, dl := range recs {
				t.Logf("record %+v", dl)
			}
		}
		return err == nil && len(recs) == 1
	})
	waitFor(t, "the rest applied", func() bool { return r.applied() == 2 })
	if r.effectsOf(ids[0]) != 1 || r.effectsOf(ids[2]) != 1 || r.effectsOf("q-1") != 0 {
		t.Errorf("effects %v", r.effects)
	}
	dl := recs[0]
	if dl.Message.ID != "q-1" || dl.Key.Scope != "test" || dl.Key.ID != "q-1" || dl.Message.Subject != r.queue {
		t.Errorf("broker dead letter %+v", dl)
	}
	if kills.Load() < 3 {
		t.Errorf("the message was delivered %d times, want 3 (limit 2)", kills.Load())
	}
	t.Logf("reason: %s", dl.Reason)
}

// Replay from the dead-letter queue applies exactly what never
// completed: a record whose key completed meanwhile is not republished.
func TestReplayAppliesWhatNeverCompleted(t *testing.T) {
	r := newRig(t)
	var broken atomic.Bool
	broken.Store(true)
	p := r.processor("replay", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if broken.Load() {
			return nil, consumer.Permanent(errors.New("bug"))
		}
		r.effect(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Permanent: 1}))
	c := r.consumer(p)
	r.declare(c)
	r.publish("x", 3)
	r.run(c)
	waitFor(t, "three dead letters", func() bool { return c.Stats().DeadLettered == 3 })
	broken.Store(false)
	// x-0 completes meanwhile (an operator re-sent it by hand).
	if d := p.Process(ctxT(t), &consumer.Message{ID: "x-0", Subject: r.queue}); d.Action != consumer.Ack {
		t.Fatalf("direct process: %+v", d)
	}
	rep, err := consumer.Replay(ctxT(t), r.dlq, r.pub, consumer.ReplayOptions{Store: r.store, Rate: -1})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Replayed != 2 || rep.AlreadyCompleted != 1 || rep.Failed != 0 {
		t.Fatalf("replay report %+v", rep)
	}
	waitFor(t, "replayed messages applied", func() bool { return r.applied() == 3 })
	waitFor(t, "replayed copies acked", func() bool { return c.Stats().Acked >= 5 })
	r.checkOnce([]string{"x-0", "x-1", "x-2"})
	if recs, err := r.dlq.List(ctxT(t), "", 0); err != nil || len(recs) != 0 {
		t.Errorf("dead letters left: %d (%v)", len(recs), err)
	}
}

func TestPublishUnroutableIsAnError(t *testing.T) {
	r := newRig(t)
	err := r.pub.Publish(ctxT(t), unique("nowhere"), &consumer.Message{ID: "u-1", Payload: []byte("x")})
	var re *ReturnError
	if !errors.As(err, &re) || re.MessageID != "u-1" {
		t.Fatalf("publish to an unbound key: %v, want a ReturnError", err)
	}
	var pe *PublishError
	if !errors.As(err, &pe) || pe.Attempts != 1 {
		t.Errorf("an unroutable message was retried: %v", err)
	}
	// The publisher still works after a return.
	if err := r.pub.Publish(ctxT(t), unique("nowhere"), &consumer.Message{ID: "u-2"}); !errors.As(err, &re) || re.MessageID != "u-2" {
		t.Errorf("second return: %v", err)
	}
}

// A work queue that exists with other arguments is a TopologyError from
// Run, not a reconnect loop; the start-up warning reaches WithWarning.
func TestRunRefusedDeclarationAndWarning(t *testing.T) {
	r := newRig(t)
	p := r.processor("topology", r.applyOnce())
	classic := r.consumer(p)
	r.declare(classic) // a classic queue with a dead-letter exchange
	var warned []Warning
	c, err := NewConsumer(r.url, r.queue, p, WithQueueType(Quorum), WithLogger(r.log),
		WithWarning(func(_ context.Context, w Warning) { warned = append(warned, w) }))
	if err != nil {
		t.Fatal(err)
	}
	err = c.Run(ctxT(t))
	var te *TopologyError
	if !errors.As(err, &te) {
		t.Fatalf("Run on a queue declared with other arguments: %v, want a TopologyError", err)
	}
	if len(warned) != 1 || warned[0].Kind != QuorumDropsAtLimit || warned[0].Queue != r.queue {
		t.Errorf("warnings %+v", warned)
	}
}
