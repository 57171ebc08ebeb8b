package dedupnats

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/sqlitestore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestDuplicatesAckedAndCounted: consumer-level duplicates (the same
// logical ID under another Nats-Msg-Id, so the broker stores both) are
// acknowledged silently, counted, and applied once.
func TestDuplicatesAckedAndCounted(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	p := r.processor("dups", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	})
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithConcurrency(4))

	want := ids("m", 20)
	for _, id := range want {
		r.publish(id)
	}
	for i, id := range want[:10] {
		r.publishRaw(map[string]string{HeaderMsgID: id, jetstream.MsgIDHeader: fmt.Sprintf("retry-%d", i)}, "again")
	}
	if n := r.streamMsgs(); n != 30 {
		t.Fatalf("stream holds %d messages, want 30 (the broker must not see the retries as duplicates)", n)
	}
	r.start(c)
	eventually(t, "30 decisions", func() bool { s := p.Stats(); return s.Applied+s.Duplicates == 30 })
	info := r.settled(durable)

	eff.exactlyOnce(t, want)
	if s := p.Stats(); s.Applied != 20 || s.Duplicates != 10 || s.Retries != 0 && s.InProgress != s.Retries {
		t.Errorf("processor stats %+v, want 20 applied and 10 duplicates", s)
	}
	if s := c.Stats(); s.Acked != 30 || s.Terminated != 0 {
		t.Errorf("consumer stats %+v, want 30 acked", s)
	}
	// Every delivery beyond the 30 messages is accounted for by a Retry
	// (two copies of one ID processed at once: the second finds the key in
	// progress). A duplicate itself is acknowledged on its first delivery.
	if s := p.Stats(); info.Delivered.Consumer != 30+s.Retries {
		t.Errorf("broker delivered %d times for 30 messages and %d retries", info.Delivered.Consumer, s.Retries)
	}
}

// TestTwoInstancesOneEffect: two consumer processes on one durable (two
// pods) with duplicates spread over both apply each logical ID once.
func TestTwoInstancesOneEffect(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	}
	durable := uniqueName(t, "C")
	_, js2 := connect(t)
	p1, p2 := r.processor("pods", h), r.processor("pods", h)
	c1 := r.consumer(nil, durable, p1, WithConcurrency(4), WithBatch(8))
	c2 := r.consumer(js2, durable, p2, WithConcurrency(4), WithBatch(8))

	want := ids("m", 40)
	for i, id := range want {
		r.publish(id)
		r.publishRaw(map[string]string{HeaderMsgID: id, jetstream.MsgIDHeader: fmt.Sprintf("dup-%d", i)}, "dup")
	}
	r.start(c1)
	r.start(c2)
	eventually(t, "every ID applied", func() bool { return eff.all(want) })
	r.settled(durable)
	eff.exactlyOnce(t, want)
	s1, s2 := p1.Stats(), p2.Stats()
	if s1.Applied+s2.Applied != 40 || s1.Duplicates+s2.Duplicates != 40 {
		t.Errorf("stats %+v and %+v, want 40 applied and 40 duplicates in all", s1, s2)
	}
}

// TestCrashAfterCommitBeforeAck: the process dies after the store
// recorded the message but before the Ack reached the broker. The
// redelivery, to a new process, is a duplicate: one effect.
func TestCrashAfterCommitBeforeAck(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	}
	want := ids("m", 5)
	victim := want[2]
	nc1, js1 := connect(t)
	var crashed atomic.Bool
	p1 := r.processor("crash-after", h, consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
		// The observer runs when the decision is made, after the store
		// completed the key and before the adapter acknowledges: kill the
		// connection there.
		if m.ID == victim && d.Action == consumer.Ack && !d.Duplicate && crashed.CompareAndSwap(false, true) {
			nc1.Close()
		}
	}))
	durable := uniqueName(t, "C")
	c1 := r.consumer(js1, durable, p1, WithAckWait(2*time.Second))
	for _, id := range want {
		r.publish(id)
	}
	err := waitRun(t, r.start(c1))
	if !crashed.Load() || !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("first process: crashed %v, Run = %v; want a crash and a closed-connection error", crashed.Load(), err)
	}
	if eff.get(victim) != 1 {
		t.Fatalf("victim applied %d times before the crash, want 1", eff.get(victim))
	}

	var dec decisions
	p2 := r.processor("crash-after", h, consumer.WithObserver(dec.observe))
	r.start(r.consumer(nil, durable, p2, WithAckWait(2*time.Second)))
	eventually(t, "the victim redelivered", func() bool { return len(dec.of(victim)) > 0 && eff.all(want) })
	r.settled(durable)

	eff.exactlyOnce(t, want)
	if d := dec.of(victim)[0]; d.Action != consumer.Ack || !d.Duplicate {
		t.Errorf("redelivery of the victim decided %+v, want an acknowledged duplicate", d)
	}
}

// TestCrashBeforeCommit: the process dies inside the handler, after its
// write but before the inbox transaction committed. The write rolls back
// with the dedup record; the redelivery applies the message: one effect.
func TestCrashBeforeCommit(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	db, err := sqlitestore.Open(filepath.Join(t.TempDir(), "inbox.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := db.DB().Exec(`CREATE TABLE effects (id TEXT NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	count := func(id string) int {
		var n int
		if err := db.DB().QueryRow(`SELECT count(*) FROM effects WHERE id = ?`, id).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	want := ids("m", 5)
	victim := want[2]
	nc1, js1 := connect(t)
	var crashed atomic.Bool
	var redelivery atomic.Int64
	newP := func(crash bool) *consumer.Processor {
		p, err := consumer.NewInbox("crash-before", db, func(ctx context.Context, tx *sql.Tx, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
			if _, err := tx.ExecContext(ctx, `INSERT INTO effects VALUES (?)`, m.ID); err != nil {
				return nil, err
			}
			if m.ID == victim {
				if crash && crashed.CompareAndSwap(false, true) {
					nc1.Close()
					return nil, errors.New("process killed before the commit")
				}
				redelivery.Store(int64(m.Delivery))
			}
			return nil, nil
		}, consumer.WithDeadLetter(r.dlq))
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	durable := uniqueName(t, "C")
	for _, id := range want {
		r.publish(id)
	}
	err = waitRun(t, r.start(r.consumer(js1, durable, newP(true), WithAckWait(2*time.Second))))
	if !crashed.Load() || !errors.Is(err, nats.ErrConnectionClosed) {
		t.Fatalf("first process: crashed %v, Run = %v; want a crash and a closed-connection error", crashed.Load(), err)
	}
	if n := count(victim); n != 0 {
		t.Fatalf("the crashed attempt's write is visible (%d rows): it was committed", n)
	}

	r.start(r.consumer(nil, durable, newP(false), WithAckWait(2*time.Second)))
	eventually(t, "every message applied", func() bool {
		for _, id := range want {
			if count(id) == 0 {
				return false
			}
		}
		return true
	})
	r.settled(durable)
	for _, id := range want {
		if n := count(id); n != 1 {
			t.Errorf("%s applied %d times, want once", id, n)
		}
	}
	if n := redelivery.Load(); n < 2 {
		t.Errorf("the victim was applied on delivery %d, want a redelivery", n)
	}
}

// TestPublishRepeatedInsideDuplicateWindow: the broker drops a repeat of
// the same Nats-Msg-Id inside its window (PubAck.Duplicate): one message
// stored, one effect.
func TestPublishRepeatedInsideDuplicateWindow(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	p := r.processor("window-in", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	})
	if dup := r.publish("order-1"); dup {
		t.Fatal("first publish reported as a duplicate")
	}
	if dup := r.publish("order-1"); !dup {
		t.Fatal("repeat inside the window not reported as a duplicate")
	}
	r.publish("order-2")
	if n := r.streamMsgs(); n != 2 {
		t.Fatalf("stream holds %d messages, want 2", n)
	}
	durable := uniqueName(t, "C")
	r.start(r.consumer(nil, durable, p))
	eventually(t, "both applied", func() bool { return eff.all([]string{"order-1", "order-2"}) })
	r.settled(durable)
	eff.exactlyOnce(t, []string{"order-1", "order-2"})
}

// TestPublishRepeatedOutsideDuplicateWindow: past the broker's window
// (1s here) the repeat is stored again; the consumer's dedup still
// applies it once.
func TestPublishRepeatedOutsideDuplicateWindow(t *testing.T) {
	t.Parallel()
	r := newRig(t, func(c *jetstream.StreamConfig) { c.Duplicates = time.Second })
	var eff effects
	p := r.processor("window-out", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	})
	durable := uniqueName(t, "C")
	r.start(r.consumer(nil, durable, p))
	if dup := r.publish("order-1"); dup {
		t.Fatal("first publish reported as a duplicate")
	}
	eventually(t, "first copy applied", func() bool { return eff.get("order-1") == 1 })
	// The server forgets IDs some time after the window: retry until it
	// accepts the repeat (each refused try stores nothing).
	eventually(t, "the broker to accept the repeat", func() bool {
		time.Sleep(time.Second)
		return !r.publish("order-1")
	})
	if n := r.streamMsgs(); n != 2 {
		t.Fatalf("stream holds %d messages, want 2 (the repeat is stored past the window)", n)
	}
	eventually(t, "the repeat processed", func() bool { return p.Stats().Duplicates == 1 })
	r.settled(durable)
	eff.exactlyOnce(t, []string{"order-1"})
}

// TestPoisonGoesToDLQWhileOthersFlow: a message that keeps failing is
// retried with delayed Naks while the messages behind it are applied, and
// then lands in the dead-letter stream with its original IDs.
func TestPoisonGoesToDLQWhileOthersFlow(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	followers := ids("f", 20)
	var poisonAttempts atomic.Int64
	p := r.processor("poison", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "poison" {
			poisonAttempts.Add(1)
			// Transient until every follower is applied, then permanent:
			// the dead letter's class proves the followers flowed past.
			if !eff.all(followers) {
				return nil, consumer.Transient(errors.New("schema registry unavailable"))
			}
			return nil, consumer.Permanent(errors.New("payload does not parse"))
		}
		eff.add(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Transient: 1000, Permanent: 3}))
	durable := uniqueName(t, "C")
	r.publish("poison", func(m *consumer.Message) {
		m.BusinessKey = "order-66"
		m.Headers = map[string]string{"Trace-Id": "t-1"}
		m.Payload = []byte("{not json")
	})
	for _, id := range followers {
		r.publish(id)
	}
	c := r.consumer(nil, durable, p)
	r.start(c)
	eventually(t, "the poison dead-lettered", func() bool { return r.dlqCount() == 1 })
	r.settled(durable)

	eff.exactlyOnce(t, followers)
	recs, err := r.dlq.List(ctxT(t), "", 10)
	if err != nil || len(recs) != 1 {
		t.Fatalf("List = %d records, %v", len(recs), err)
	}
	dl := recs[0]
	switch {
	case dl.Class != consumer.ClassPermanent:
		t.Errorf("dead-lettered as %s, want permanent (followers were blocked behind the poison)", dl.Class)
	case dl.Message.ID != "poison" || dl.Key.ID != "poison" || dl.Message.BusinessKey != "order-66":
		t.Errorf("record lost the original IDs: %+v", dl)
	case string(dl.Message.Payload) != "{not json" || dl.Message.Headers["Trace-Id"] != "t-1":
		t.Errorf("record lost the payload or headers: %+v", dl.Message)
	case !strings.Contains(dl.Reason, "payload does not parse") || dl.Consumer != "poison":
		t.Errorf("record reason %q consumer %q", dl.Reason, dl.Consumer)
	}
	if n := poisonAttempts.Load(); n < 2 {
		t.Errorf("poison ran %d times, want retries", n)
	}
	if s := c.Stats(); s.Terminated != 1 || s.Naked == 0 {
		t.Errorf("consumer stats %+v, want the poison Nak'd, then terminated", s)
	}
}

// replaySetup dead-letters broken[0..n-1] and lets the last of them
// complete meanwhile (a producer retry after the fix). It returns the rig,
// the effects and the publisher-observed messages.
func replaySetup(t *testing.T, n int) (*rig, *effects, *sync.Map, []string, string) {
	r := newRig(t)
	eff := &effects{}
	var broken atomic.Bool
	broken.Store(true)
	seen := &sync.Map{} // id -> last *consumer.Message
	p := r.processor("replay", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if broken.Load() && strings.HasPrefix(m.ID, "r-") {
			return nil, consumer.Permanent(errBroken)
		}
		c := m.Clone()
		seen.Store(m.ID, &c)
		eff.add(m.ID)
		return nil, nil
	}, consumer.WithLimits(consumer.Limits{Permanent: 1}))
	durable := uniqueName(t, "C")
	r.start(r.consumer(nil, durable, p))
	dead := ids("r", n)
	for _, id := range dead {
		r.publish(id, func(m *consumer.Message) { m.BusinessKey = "bk-" + id })
	}
	r.publish("ok-1")
	eventually(t, "all dead-lettered", func() bool { return r.dlqCount() == uint64(n) && eff.get("ok-1") == 1 })

	// The handler is fixed; the producer of the last one retries it (a new
	// stream message, same logical ID): it completes outside any replay.
	broken.Store(false)
	done := dead[n-1]
	r.publishRaw(map[string]string{HeaderMsgID: done, jetstream.MsgIDHeader: done + "-producer-retry"}, "retry")
	eventually(t, done+" completed", func() bool { return eff.get(done) == 1 })
	r.settled(durable)
	return r, eff, seen, dead, done
}

// TestReplayFromDLQAppliesOnlyIncomplete: consumer.Replay from the
// dead-letter stream through the Publisher applies exactly the messages
// that never completed, under their original IDs; the one that completed
// meanwhile is AlreadyCompleted and not applied again.
func TestReplayFromDLQAppliesOnlyIncomplete(t *testing.T) {
	t.Parallel()
	r, eff, seen, dead, done := replaySetup(t, 4)
	rep, err := consumer.Replay(ctxT(t), r.dlq, r.pub, consumer.ReplayOptions{Store: r.store, Rate: -1})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Seen != 4 || rep.Replayed != 3 || rep.AlreadyCompleted != 1 || rep.Failed != 0 {
		t.Fatalf("replay report %+v, want 3 replayed and 1 already completed", rep)
	}
	for _, it := range rep.Items {
		if (it.Record.Message.ID == done) != (it.Status == consumer.AlreadyCompleted) {
			t.Errorf("record %s: %s", it.Record.Message.ID, it.Status)
		}
	}
	eventually(t, "replays applied", func() bool { return eff.all(dead) })
	time.Sleep(500 * time.Millisecond) // room for a wrong second effect to show
	eff.exactlyOnce(t, append(dead, "ok-1"))
	if n := r.dlqCount(); n != 0 {
		t.Errorf("%d records left in the dead-letter stream, want 0", n)
	}
	for _, id := range dead[:3] {
		v, _ := seen.Load(id)
		m := v.(*consumer.Message)
		if m.Headers[HeaderMsgID] != id || !strings.HasPrefix(m.Headers[jetstream.MsgIDHeader], id+"/replay/") || m.BusinessKey != "bk-"+id {
			t.Errorf("replayed %s arrived with headers %v business key %q", id, m.Headers, m.BusinessKey)
		}
	}
}

// TestReplayDryRunChangesNothing: a dry run reports what it would do and
// leaves the dead-letter stream, the broker and the dedup store as they
// were.
func TestReplayDryRunChangesNothing(t *testing.T) {
	t.Parallel()
	r, eff, _, dead, done := replaySetup(t, 3)
	before, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil {
		t.Fatal(err)
	}
	msgs := r.streamMsgs()
	effBefore := eff.snapshot()

	rep, err := consumer.Replay(ctxT(t), r.dlq, r.pub, consumer.ReplayOptions{Store: r.store, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if rep.WouldReplay != 2 || rep.AlreadyCompleted != 1 || rep.Replayed != 0 {
		t.Fatalf("dry run report %+v, want 2 would replay and 1 already completed", rep)
	}
	after, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != len(before) {
		t.Fatalf("dead-letter stream went from %d to %d records", len(before), len(after))
	}
	for i := range before {
		if before[i].ID != after[i].ID {
			t.Errorf("record %d changed ID: %s -> %s", i, before[i].ID, after[i].ID)
		}
	}
	if m := r.streamMsgs(); m != msgs {
		t.Errorf("stream went from %d to %d messages: the dry run published", msgs, m)
	}
	time.Sleep(300 * time.Millisecond)
	if got := eff.snapshot(); len(got) != len(effBefore) {
		t.Errorf("effects changed: %v -> %v", effBefore, got)
	}
	// Nothing was recorded in the store: the keys are still claimable.
	for _, id := range dead[:2] {
		c, err := r.store.Claim(ctxT(t), dedup.Key{Scope: "replay", ID: id}, "", time.Second)
		if err != nil || c.Outcome != dedup.Acquired {
			t.Errorf("after the dry run %s is %v (%v), want still absent", id, c.Outcome, err)
		} else if err := r.store.Release(ctxT(t), c); err != nil {
			t.Fatal(err)
		}
	}
	_ = done
}

// TestTransientIsNakedWithDelay: a transient failure is negatively
// acknowledged with the processor's delay; the broker redelivers after
// that delay, long before AckWait.
func TestTransientIsNakedWithDelay(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	type call struct {
		at       time.Time
		delivery int
	}
	var mu sync.Mutex
	var calls []call
	var retryAt time.Time
	var delay time.Duration
	p := r.processor("transient", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		mu.Lock()
		calls = append(calls, call{time.Now(), m.Delivery})
		n := len(calls)
		mu.Unlock()
		if n == 1 {
			return nil, consumer.Transient(errors.New("connection refused"))
		}
		return nil, nil
	}, consumer.WithBackoff(800*time.Millisecond, 2*time.Second), consumer.WithObserver(func(m *consumer.Message, d consumer.Decision) {
		if d.Action == consumer.Retry {
			mu.Lock()
			retryAt, delay = time.Now(), d.Delay
			mu.Unlock()
		}
	}))
	// AckWait is far beyond the test's own deadline: a redelivery that
	// arrives at all was brought back by the Nak's delay, not by AckWait.
	const ackWait = time.Hour
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithAckWait(ackWait))
	r.publish("flaky")
	r.start(c)
	eventually(t, "applied after a retry", func() bool { return p.Stats().Applied == 1 })
	r.settled(durable)

	mu.Lock()
	defer mu.Unlock()
	if len(calls) != 2 || calls[1].delivery != 2 {
		t.Fatalf("calls %+v, want two deliveries", calls)
	}
	if delay <= 0 {
		t.Fatal("no Retry decision observed")
	}
	// A lower bound only: the broker must not bring the message back before
	// the delay the Nak asked for. A slow machine can only make it later, so
	// this cannot fail from load.
	if waited := calls[1].at.Sub(retryAt); waited < delay {
		t.Errorf("redelivered %s after the Nak, before its delay of %s", waited, delay)
	}
	if s := c.Stats(); s.Naked != 1 || s.Acked != 1 {
		t.Errorf("consumer stats %+v, want one Nak and one Ack", s)
	}
}

// TestInProgressKeepsLongHandlerAlive: a handler that runs 2.5 times the
// AckWait is not redelivered: the consumer's InProgress heartbeat keeps
// the broker waiting.
func TestInProgressKeepsLongHandlerAlive(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var calls atomic.Int64
	p := r.processor("long", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		calls.Add(1)
		select {
		case <-time.After(2500 * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return nil, nil
	})
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithAckWait(time.Second))
	r.publish("slow")
	r.start(c)
	eventually(t, "applied", func() bool { return p.Stats().Applied == 1 })
	info := r.settled(durable)
	if n := calls.Load(); n != 1 {
		t.Errorf("handler ran %d times, want once", n)
	}
	if info.Delivered.Consumer != 1 {
		t.Errorf("broker delivered %d times, want once", info.Delivered.Consumer)
	}
	if s := c.Stats(); s.InProgress == 0 || s.Acked != 1 {
		t.Errorf("consumer stats %+v, want InProgress heartbeats and one Ack", s)
	}
}

// TestDuplicateWindowWarning: Run warns (log and hook) when the stream's
// duplicate window is shorter than the processor's retention, and when
// the stream keeps messages longer than it; and is silent when both are
// covered.
func TestDuplicateWindowWarning(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, adjust func(*jetstream.StreamConfig), retention time.Duration) ([]WindowWarning, string) {
		r := newRig(t, adjust)
		var mu sync.Mutex
		var got []WindowWarning
		var logs bytes.Buffer
		logger := slog.New(slog.NewTextHandler(&lockedWriter{mu: &mu, w: &logs}, nil))
		p := r.processor("window", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
			return nil, nil
		}, consumer.WithRetention(retention))
		durable := uniqueName(t, "C")
		c := r.consumer(nil, durable, p, WithLogger(logger), WithWindowWarning(func(ctx context.Context, w WindowWarning) {
			mu.Lock()
			got = append(got, w)
			mu.Unlock()
		}))
		r.start(c)
		// The durable consumer is created after the check.
		eventually(t, "the durable consumer", func() bool {
			_, err := r.js.Consumer(ctxT(t), r.stream, durable)
			return err == nil
		})
		c.Close()
		mu.Lock()
		defer mu.Unlock()
		return got, logs.String()
	}
	t.Run("short", func(t *testing.T) {
		t.Parallel()
		got, logs := run(t, func(c *jetstream.StreamConfig) { c.Duplicates = time.Minute }, 24*time.Hour)
		kinds := map[WarningKind]WindowWarning{}
		for _, w := range got {
			kinds[w.Kind] = w
		}
		w, ok := kinds[DuplicateWindowShort]
		if !ok || w.Duplicates != time.Minute || w.Retention != 24*time.Hour || w.Stream == "" || w.Durable == "" {
			t.Errorf("warnings %+v, want a duplicate-window warning with 1m against 24h", got)
		}
		if _, ok := kinds[StreamOutlivesRetention]; !ok {
			t.Errorf("warnings %+v, want a stream-outlives-retention warning (MaxAge unlimited)", got)
		}
		if !strings.Contains(logs, "duplicate window shorter than retention") || !strings.Contains(logs, "level=WARN") {
			t.Errorf("log %q lacks the warning", logs)
		}
	})
	t.Run("covered", func(t *testing.T) {
		t.Parallel()
		got, logs := run(t, func(c *jetstream.StreamConfig) {
			c.Duplicates, c.MaxAge = 2*time.Minute, 2*time.Minute
		}, 2*time.Minute)
		if len(got) != 0 || strings.Contains(logs, "retention") {
			t.Errorf("warnings %+v, log %q; want none", got, logs)
		}
	})
}

type lockedWriter struct {
	mu *sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// TestMaxDeliverExhaustionDeadLetters: with MaxDeliver set, a message
// still failing on its last allowed delivery is dead-lettered, never
// dropped by the broker.
func TestMaxDeliverExhaustionDeadLetters(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	var stuckCalls atomic.Int64
	p := r.processor("maxdeliver", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == "stuck" {
			stuckCalls.Add(1)
			return nil, consumer.Transient(errors.New("downstream timeout"))
		}
		eff.add(m.ID)
		return nil, nil
	})
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithMaxDeliver(2))
	r.publish("stuck")
	r.publish("fine")
	r.start(c)
	eventually(t, "dead-lettered", func() bool { return r.dlqCount() == 1 && eff.get("fine") == 1 })
	info := r.settled(durable)
	if info.Config.MaxDeliver != 2 {
		t.Errorf("durable MaxDeliver %d, want 2", info.Config.MaxDeliver)
	}
	recs, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil || len(recs) != 1 || recs[0].Message.ID != "stuck" {
		t.Fatalf("records %+v, %v", recs, err)
	}
	if !strings.Contains(recs[0].Reason, "will not redeliver") || recs[0].Message.Delivery != 2 {
		t.Errorf("record reason %q delivery %d", recs[0].Reason, recs[0].Message.Delivery)
	}
	if n := stuckCalls.Load(); n != 2 {
		t.Errorf("stuck ran %d times, want once per allowed delivery", n)
	}
	if s := c.Stats(); s.GaveUp != 1 || s.Terminated != 1 {
		t.Errorf("consumer stats %+v, want one give-up, terminated", s)
	}
	eff.exactlyOnce(t, []string{"fine"})
}

// TestMalformedVersionDeadLettered: a Dedup-Version that does not parse
// does not crash the consumer or reach the handler; the message is
// dead-lettered with a reason naming the header, and the stream moves on.
func TestMalformedVersionDeadLettered(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	var seen sync.Map
	p := r.processor("versions", func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		c := m.Clone()
		seen.Store(m.ID, &c)
		eff.add(m.ID)
		return nil, nil
	})
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p)
	r.publishRaw(map[string]string{HeaderMsgID: "bad-v", HeaderVersion: "v7", HeaderAggregate: "acct-1"}, "x")
	r.publish("good", func(m *consumer.Message) { m.Aggregate, m.Version = "acct-1", 8 })
	r.start(c)
	eventually(t, "dead letter and the next message", func() bool { return r.dlqCount() == 1 && eff.get("good") == 1 })
	r.settled(durable)
	eff.exactlyOnce(t, []string{"good"})
	recs, err := r.dlq.List(ctxT(t), "", 0)
	if err != nil || len(recs) != 1 {
		t.Fatalf("records %+v, %v", recs, err)
	}
	dl := recs[0]
	if dl.Message.ID != "bad-v" || dl.Class != consumer.ClassPermanent || !strings.Contains(dl.Reason, HeaderVersion) ||
		dl.Message.Headers[HeaderVersion] != "v7" {
		t.Errorf("record %+v", dl)
	}
	v, _ := seen.Load("good")
	if m := v.(*consumer.Message); m.Version != 8 || m.Aggregate != "acct-1" {
		t.Errorf("good message arrived as version %d aggregate %q", m.Version, m.Aggregate)
	}
	if s := c.Stats(); s.EnvelopeErrors != 1 || s.Terminated != 1 {
		t.Errorf("consumer stats %+v", s)
	}
}

// TestCloseDrainsInFlightAndReleasesQueued: Close lets the message being
// processed finish and be acknowledged, hands the queued ones back, and
// another instance applies them: one effect each.
func TestCloseDrainsInFlightAndReleasesQueued(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	var eff effects
	started, release := make(chan struct{}), make(chan struct{})
	want := ids("m", 5)
	h := func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		if m.ID == want[0] && d.Attempt == 1 && eff.get(m.ID) == 0 {
			close(started)
			<-release
		}
		eff.add(m.ID)
		return nil, nil
	}
	durable := uniqueName(t, "C")
	c1 := r.consumer(nil, durable, r.processor("drain", h), WithAckWait(30*time.Second))
	for _, id := range want {
		r.publish(id)
	}
	errc := r.start(c1)
	<-started
	closed := make(chan struct{})
	go func() { c1.Close(); close(closed) }()
	eventually(t, "Close to stop the pull", func() bool { return c1.stopping.Load() })
	close(release)
	<-closed
	if err := waitRun(t, errc); err != nil {
		t.Fatalf("Run after Close = %v, want nil", err)
	}
	if err := c1.Run(context.Background()); !errors.Is(err, ErrClosed) {
		t.Errorf("Run after Close = %v, want ErrClosed", err)
	}
	if got := eff.snapshot(); len(got) != 1 || got[want[0]] != 1 {
		t.Fatalf("effects after Close %v, want only the in-flight message", got)
	}
	s := c1.Stats()
	if s.Acked != 1 || s.Naked != s.Fetched-1 {
		t.Errorf("stats %+v, want the in-flight message acked and the rest released", s)
	}

	r.start(r.consumer(nil, durable, r.processor("drain", h)))
	eventually(t, "the rest applied", func() bool { return eff.all(want) })
	r.settled(durable)
	eff.exactlyOnce(t, want)
}

// TestDLQStore: the dead-letter stream as a consumer.DeadLetterStore:
// idempotent writes, paging by sequence, Get, Delete, ErrNotFound.
func TestDLQStore(t *testing.T) {
	t.Parallel()
	_, js := connect(t)
	ctx := ctxT(t)
	name := uniqueName(t, "DLQ")
	q, err := NewDLQ(ctx, js, name) // default: file storage
	if err != nil {
		t.Fatal(err)
	}
	deleteStreamOnCleanup(t, name)
	if _, err := NewDLQ(ctx, js, name); err != nil {
		t.Fatalf("reopen: %v", err)
	}
	if _, err := NewDLQ(ctx, js, name, WithSubjectPrefix("elsewhere")); err == nil {
		t.Fatal("reopen with other subjects: no error")
	}
	info, err := js.Stream(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if cfg := info.CachedInfo().Config; cfg.Storage != jetstream.FileStorage || cfg.Discard != jetstream.DiscardNew || cfg.MaxAge != 0 {
		t.Errorf("stream config storage %v discard %v max age %v", cfg.Storage, cfg.Discard, cfg.MaxAge)
	}

	t0 := time.Date(2025, 1, 2, 3, 4, 5, 6, time.UTC)
	rec := func(i int) consumer.DeadLetter {
		id := fmt.Sprintf("msg-%d", i)
		return consumer.DeadLetter{
			Consumer: "billing", Key: dedup.Key{Scope: "billing", ID: id},
			Message: consumer.Message{ID: id, BusinessKey: "bk", Subject: "orders.x", Payload: []byte{0, 1, 2, byte(i)},
				Headers: map[string]string{"A": "b"}, Delivery: 3, Published: t0},
			Class: consumer.ClassPermanent, Reason: "bad", Attempts: 3,
			FirstFailure: t0.Add(time.Duration(i) * time.Second), LastFailure: t0.Add(time.Hour),
		}
	}
	for i := range 5 {
		if err := q.DeadLetter(ctx, rec(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := q.DeadLetter(ctx, rec(2)); err != nil { // a retry after a lost ack
		t.Fatal(err)
	}
	if n, err := q.Count(ctx); err != nil || n != 5 {
		t.Fatalf("Count = %d, %v; want 5 (the repeated write is stored once)", n, err)
	}

	var all []consumer.DeadLetter
	after := ""
	for {
		page, err := q.List(ctx, after, 2)
		if err != nil {
			t.Fatal(err)
		}
		if len(page) == 0 {
			break
		}
		if len(page) > 2 {
			t.Fatalf("page of %d, limit 2", len(page))
		}
		all = append(all, page...)
		after = page[len(page)-1].ID
	}
	if len(all) != 5 {
		t.Fatalf("paged %d records, want 5", len(all))
	}
	for i, dl := range all {
		w := rec(i)
		w.ID = dl.ID
		if dl.Message.ID != w.Message.ID || !bytes.Equal(dl.Message.Payload, w.Message.Payload) || dl.Key != w.Key ||
			!dl.FirstFailure.Equal(w.FirstFailure) || !dl.Message.Published.Equal(t0) || dl.Message.Headers["A"] != "b" ||
			dl.Class != w.Class || dl.Attempts != 3 || dl.Consumer != "billing" {
			t.Errorf("record %d = %+v, want %+v", i, dl, w)
		}
		if i > 0 && all[i-1].ID >= dl.ID && len(all[i-1].ID) >= len(dl.ID) {
			t.Errorf("records out of order: %s then %s", all[i-1].ID, dl.ID)
		}
	}

	got, err := q.Get(ctx, all[1].ID)
	if err != nil || got.Message.ID != "msg-1" {
		t.Fatalf("Get = %+v, %v", got, err)
	}
	if err := q.Delete(ctx, all[1].ID); err != nil {
		t.Fatal(err)
	}
	if _, err := q.Get(ctx, all[1].ID); !errors.Is(err, consumer.ErrNotFound) {
		t.Errorf("Get deleted = %v, want ErrNotFound", err)
	}
	if err := q.Delete(ctx, all[1].ID); err != nil {
		t.Errorf("Delete missing = %v, want nil", err)
	}
	if _, err := q.Get(ctx, "999999"); !errors.Is(err, consumer.ErrNotFound) {
		t.Errorf("Get beyond the end = %v, want ErrNotFound", err)
	}
	if _, err := q.Get(ctx, "abc"); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Get bad id = %v, want an argument error", err)
	}
	rest, err := q.List(ctx, "", 0)
	if err != nil || len(rest) != 4 {
		t.Fatalf("List after delete = %d, %v", len(rest), err)
	}
	for _, dl := range rest {
		if dl.ID == all[1].ID {
			t.Error("deleted record listed")
		}
	}
}

// TestRepublishKeepsLogicalID: Publish sets both IDs; Republish keeps
// Dedup-Msg-Id and uses a fresh Nats-Msg-Id, so the broker stores the
// replay even inside its duplicate window.
func TestRepublishKeepsLogicalID(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	ctx := ctxT(t)
	m := &consumer.Message{ID: "evt-1", BusinessKey: "order-9", Aggregate: "order-9", Version: 4,
		Payload: []byte("p"), Headers: map[string]string{"Trace-Id": "t", HeaderVersion: "999"}}
	if dup, err := r.pub.Publish(ctx, r.subject, m); err != nil || dup {
		t.Fatalf("Publish = %v, %v", dup, err)
	}
	if dup, err := r.pub.Publish(ctx, r.subject, m); err != nil || !dup {
		t.Fatalf("repeat = %v, %v; want a duplicate", dup, err)
	}
	s, err := r.js.Stream(ctx, r.stream)
	if err != nil {
		t.Fatal(err)
	}
	first, err := s.GetMsg(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	h := first.Header
	if h.Get(HeaderMsgID) != "evt-1" || h.Get(jetstream.MsgIDHeader) != "evt-1" || h.Get(HeaderBusinessKey) != "order-9" ||
		h.Get(HeaderAggregate) != "order-9" || h.Get(HeaderVersion) != "4" || h.Get("Trace-Id") != "t" {
		t.Errorf("published headers %v", h)
	}

	// As Replay would: the message as read, Nats-Msg-Id included.
	read := m.Clone()
	read.Subject = r.subject
	read.Headers[jetstream.MsgIDHeader] = "evt-1"
	for range 2 {
		if err := r.pub.Republish(ctx, &read); err != nil {
			t.Fatal(err)
		}
	}
	if n := r.streamMsgs(); n != 3 {
		t.Fatalf("stream holds %d messages, want 3 (replays are not swallowed by the window)", n)
	}
	ids := map[string]bool{}
	for seq := uint64(2); seq <= 3; seq++ {
		rm, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		nid := rm.Header.Get(jetstream.MsgIDHeader)
		if rm.Header.Get(HeaderMsgID) != "evt-1" || !strings.HasPrefix(nid, "evt-1/replay/") || rm.Header.Get(HeaderBusinessKey) != "order-9" {
			t.Errorf("replay headers %v", rm.Header)
		}
		ids[nid] = true
	}
	if len(ids) != 2 {
		t.Errorf("two replays shared a Nats-Msg-Id: %v", ids)
	}

	if _, err := r.pub.Publish(ctx, r.subject, &consumer.Message{Payload: []byte("x")}); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Publish without an ID = %v, want an argument error", err)
	}
	if _, err := r.pub.Publish(ctx, "", &consumer.Message{ID: "x"}); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Publish without a subject = %v, want an argument error", err)
	}
	if err := r.pub.Republish(ctx, nil); !errors.Is(err, dedup.ErrInvalidArgument) {
		t.Errorf("Republish(nil) = %v", err)
	}
}
