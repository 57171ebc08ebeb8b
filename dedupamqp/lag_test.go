package dedupamqp

import (
	"context"
	"testing"

	"github.com/dedupkit/dedup/consumer"
)

// TestDepth: Depth fails before Run; with a handler that holds its one
// delivery (prefetch 1), four of five messages wait in the queue; once
// released and acknowledged, none.
func TestDepth(t *testing.T) {
	r := newRig(t)
	release := make(chan struct{})
	p := r.processor("depth", func(ctx context.Context, m *consumer.Message, _ consumer.Delivery) ([]byte, error) {
		select {
		case <-release:
		case <-ctx.Done():
		}
		r.effect(m.ID)
		return nil, nil
	})
	c := r.consumer(p, WithConcurrency(1), WithPrefetch(1))
	if _, err := c.Depth(ctxT(t)); err == nil {
		t.Error("Depth before Run: no error")
	}
	r.declare(c)
	ids := r.publish("d", 5)
	r.run(c)
	var held Depth
	waitFor(t, "four messages waiting behind the held one", func() bool {
		d, err := c.Depth(ctxT(t))
		held = d
		return err == nil && d.Ready == 4 && d.Consumers == 1 && c.Stats().Delivered == 1
	})
	t.Logf("held: %+v", held)
	close(release)
	waitFor(t, "an empty queue after five acks", func() bool {
		d, err := c.Depth(ctxT(t))
		return err == nil && d.Ready == 0 && c.Stats().Acked == 5
	})
	r.checkOnce(ids)
}
