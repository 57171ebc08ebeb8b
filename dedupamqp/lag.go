package dedupamqp

import (
	"context"
	"errors"
	"fmt"
)

// Depth is what RabbitMQ says of the consumer's queue.
type Depth struct {
	// Ready counts the messages waiting in the queue: not delivered yet
	// (delivered and unacknowledged ones are not among them).
	Ready int
	// Consumers counts the consumers on the queue.
	Consumers int
}

// errNotConnected is Depth's error while the consumer has no session.
var errNotConnected = errors.New("dedupamqp: not connected")

// Depth asks RabbitMQ for the queue's depth with a passive declare on a
// channel of its own over the consumer's live connection: one round trip,
// so call it at a scrape, not per message. It fails while the consumer is
// not connected (before Run, or between a lost connection and the next).
func (c *Consumer) Depth(ctx context.Context) (Depth, error) {
	conn := c.conn()
	if conn == nil || conn.IsClosed() {
		return Depth{}, errNotConnected
	}
	ch, err := conn.Channel()
	if err != nil {
		return Depth{}, fmt.Errorf("dedupamqp: depth of %s: %w", c.queue, err)
	}
	type answer struct {
		d   Depth
		err error
	}
	done := make(chan answer, 1)
	go func() {
		q, err := ch.QueueDeclarePassive(c.queue, true, false, false, false, nil)
		done <- answer{Depth{Ready: q.Messages, Consumers: q.Consumers}, err}
	}()
	select {
	case a := <-done:
		ch.Close()
		if a.err != nil {
			return Depth{}, fmt.Errorf("dedupamqp: depth of %s: %w", c.queue, a.err)
		}
		return a.d, nil
	case <-ctx.Done():
		ch.Close() // ends the declare in flight
		return Depth{}, fmt.Errorf("dedupamqp: depth of %s: %w", c.queue, ctx.Err())
	}
}
