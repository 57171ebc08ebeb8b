package dedupnats

import (
	"context"
	"fmt"
)

// Lag is what the JetStream server says of a durable consumer's backlog.
type Lag struct {
	// Pending counts the stream's messages not yet delivered to the
	// consumer (num_pending).
	Pending uint64
	// AckPending counts messages delivered and not acknowledged yet
	// (num_ack_pending): being processed, or waiting out AckWait after a
	// crash.
	AckPending int
	// Redelivered counts those of them delivered more than once
	// (num_redelivered).
	Redelivered int
}

// Lag asks the server for the durable consumer's backlog: one request,
// so call it at a scrape, not per message. The durable exists once Run
// has started; before that the server's "consumer not found" is returned.
func (c *Consumer) Lag(ctx context.Context) (Lag, error) {
	cons, err := c.js.Consumer(ctx, c.stream, c.durable)
	if err != nil {
		return Lag{}, fmt.Errorf("dedupnats: durable consumer %s on %s: %w", c.durable, c.stream, err)
	}
	info, err := cons.Info(ctx)
	if err != nil {
		return Lag{}, fmt.Errorf("dedupnats: info of durable consumer %s on %s: %w", c.durable, c.stream, err)
	}
	return Lag{Pending: info.NumPending, AckPending: info.NumAckPending, Redelivered: info.NumRedelivered}, nil
}
