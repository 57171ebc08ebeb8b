package dedupnats

import (
	"context"
	"testing"
	"time"

	"github.com/dedupkit/dedup/consumer"
)

// TestLag: with a handler that holds every message, five published
// messages show in the durable's backlog (not delivered, or delivered and
// not acknowledged); once released and acknowledged, the backlog is empty.
func TestLag(t *testing.T) {
	r := newRig(t)
	release := make(chan struct{})
	p := r.processor("lag", func(ctx context.Context, _ *consumer.Message, _ consumer.Delivery) ([]byte, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		return nil, nil
	})
	c := r.consumer(nil, "lag", p)
	if _, err := c.Lag(ctxT(t)); err == nil {
		t.Error("Lag before the durable exists: no error")
	}
	r.start(c)
	for i := range 5 {
		r.publish("lag-" + string(rune('a'+i)))
	}
	wait := func(what string, ok func(Lag) bool) Lag {
		t.Helper()
		deadline := time.Now().Add(waitLong)
		for {
			l, err := c.Lag(ctxT(t))
			if err == nil && ok(l) {
				return l
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s never reported: last %+v, %v", what, l, err)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	l := wait("five messages held", func(l Lag) bool { return l.Pending+uint64(l.AckPending) == 5 && l.AckPending > 0 })
	t.Logf("held: %+v", l)
	close(release)
	wait("an empty backlog after five acks", func(l Lag) bool { return l.Pending == 0 && l.AckPending == 0 && c.Stats().Acked == 5 })
}
