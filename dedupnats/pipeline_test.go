package dedupnats

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/internal/redistest"
)

// newHeldStore holds the first batch completion.
func newHeldStore(t *testing.T) *redistest.Held {
	t.Helper()
	return redistest.NewHeld(t, "npipe:"+t.Name()+":"+strconv.FormatInt(time.Now().UnixNano(), 36)+":", nil)
}

// TestBatchPipelineAcksAfterCompletion: with batch processing on Redis,
// nothing of a batch is acknowledged (or negatively acknowledged) while
// its completion is in flight; a completion that finds a lease lost (the
// record deleted meanwhile) makes that message a Retry, Nak'd and
// redelivered, never acknowledged as done; the others are acknowledged
// once the completion returned.
func TestBatchPipelineAcksAfterCompletion(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	store := newHeldStore(t)
	var eff effects
	var dec decisions
	p, err := consumer.New("npipe", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	}, consumer.WithDeadLetter(r.dlq), consumer.WithBackoff(20*time.Millisecond, 300*time.Millisecond),
		consumer.WithObserver(dec.observe))
	if err != nil {
		t.Fatal(err)
	}
	want := ids("p", 30)
	for _, id := range want {
		r.publish(id)
	}
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithBatchProcessing(), WithBatch(16))
	r.start(c)
	t.Cleanup(store.Open)

	items := <-store.Entered
	if s := c.Stats(); s.Acked != 0 || s.Naked != 0 || s.Terminated != 0 {
		t.Fatalf("stats %+v while the first batch's completion is in flight: want nothing settled", s)
	}
	lost := items[0].Claim.Key
	rc := store.Client()
	if err := rc.Do(ctxT(t), rc.B().Del().Key(store.RedisKey(lost)).Build()).Error(); err != nil {
		t.Fatal(err)
	}
	store.Open()

	eventually(t, "every message applied", func() bool { return eff.all(want) && p.Stats().Applied == uint64(len(want)) && eff.get(lost.ID) == 2 })
	info := r.settled(durable)
	ds := dec.of(lost.ID)
	if len(ds) != 2 || ds[0].Action != consumer.Retry || ds[1].Action != consumer.Ack {
		t.Errorf("%s (its record deleted under its completion): decisions %+v, want Retry then Ack", lost.ID, ds)
	}
	for _, id := range want {
		n := 1
		if id == lost.ID {
			n = 2 // its record was lost: applied again
		}
		if got := eff.get(id); got != n {
			t.Errorf("%s applied %d times, want %d", id, got, n)
		}
	}
	if s := c.Stats(); s.Acked != uint64(len(want)) || s.Naked != 1 {
		t.Errorf("stats %+v: want %d acks and one Nak", s, len(want))
	}
	if info.Delivered.Consumer != uint64(len(want))+1 {
		t.Errorf("broker delivered %d times, want %d (one redelivery)", info.Delivered.Consumer, len(want)+1)
	}
}

// TestBatchPipelineCloseWaitsForCompletionInFlight: Close during a batch's
// completion (held in the store) waits for it: nothing of the batch is
// settled while it is held, Close returns only after it returned, the
// batch is acknowledged then (its records completed), and a new consumer
// on the same durable applies every other message once: nothing lost,
// nothing applied twice.
func TestBatchPipelineCloseWaitsForCompletionInFlight(t *testing.T) {
	t.Parallel()
	r := newRig(t)
	store := newHeldStore(t)
	var eff effects
	p, err := consumer.New("npipe-close", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		eff.add(m.ID)
		return nil, nil
	}, consumer.WithDeadLetter(r.dlq), consumer.WithBackoff(20*time.Millisecond, 300*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	want := ids("q", 40)
	for _, id := range want {
		r.publish(id)
	}
	durable := uniqueName(t, "C")
	c := r.consumer(nil, durable, p, WithBatchProcessing(), WithBatch(16))
	errc := r.start(c)
	t.Cleanup(store.Open)

	items := <-store.Entered
	closed := make(chan struct{})
	go func() { c.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatal("Close returned while a batch's completion was in flight")
	case <-time.After(300 * time.Millisecond):
	}
	if s := c.Stats(); s.Acked != 0 {
		t.Fatalf("stats %+v while the first completion is held: want nothing acknowledged", s)
	}
	store.Open()
	select {
	case <-closed:
	case <-time.After(waitLong):
		t.Fatal("Close did not return after the completion")
	}
	if err := waitRun(t, errc); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if s := c.Stats(); s.Acked < uint64(len(items)) {
		t.Errorf("stats %+v after Close: want at least the %d messages of the held batch acknowledged", s, len(items))
	}

	c2 := r.consumer(nil, durable, p, WithBatchProcessing(), WithBatch(16))
	r.start(c2)
	eventually(t, "every message applied", func() bool { return eff.all(want) })
	r.settled(durable)
	eff.exactlyOnce(t, want)
}
