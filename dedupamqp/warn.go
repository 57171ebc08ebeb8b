package dedupamqp

import (
	"context"
	"log/slog"
)

// WarningKind names a start-up warning.
type WarningKind uint8

const (
	// QuorumDropsAtLimit: a quorum queue with no dead-letter exchange. A
	// quorum queue drops a message once it has been returned more times
	// than its delivery limit (x-delivery-limit; 20 by default from
	// RabbitMQ 4 on), so a message that crashes its consumer again and
	// again is lost instead of dead-lettered.
	QuorumDropsAtLimit WarningKind = iota + 1
	// ClassicNoDeadLetter: a classic queue with no dead-letter exchange.
	// The processor's own dead letters go to its sink either way; what
	// the broker gives up on (a rejection, an expiry, a length limit) is
	// dropped.
	ClassicNoDeadLetter
	// QueueNotChecked: the work queue was declared elsewhere
	// ([WithoutDeclare]) and AMQP cannot read a queue's arguments back,
	// so its dead-letter settings are unknown to the adapter.
	QueueNotChecked
)

func (k WarningKind) String() string {
	switch k {
	case QuorumDropsAtLimit:
		return "quorum queue without a dead-letter exchange drops messages at its delivery limit"
	case ClassicNoDeadLetter:
		return "classic queue without a dead-letter exchange"
	case QueueNotChecked:
		return "queue declared elsewhere: dead-letter settings not checked"
	}
	return "warning(?)"
}

// A Warning is a queue configuration that can lose messages, found when
// Run starts.
type Warning struct {
	Kind          WarningKind
	Queue         string
	QueueType     string
	DeliveryLimit int // 0: not set by the adapter
}

// Warnings returns what Run will warn about, without I/O.
func (c *Consumer) Warnings() []Warning {
	w := Warning{Queue: c.queue, QueueType: c.cfg.queueType, DeliveryLimit: c.cfg.deliveryLimit}
	switch {
	case !c.cfg.declare:
		w.Kind = QueueNotChecked
	case c.cfg.dlx != "":
		return nil
	case c.cfg.queueType == Quorum:
		w.Kind = QuorumDropsAtLimit
	default:
		w.Kind = ClassicNoDeadLetter
	}
	return []Warning{w}
}

func (c *Consumer) warn(ctx context.Context) {
	for _, w := range c.Warnings() {
		c.cfg.logger.Warn("dedupamqp: "+w.Kind.String(), slog.String("queue", w.Queue),
			slog.String("queue_type", w.QueueType), slog.Int("delivery_limit", w.DeliveryLimit),
			slog.String("consumer", c.p.Name()))
		if c.cfg.onWarning != nil {
			c.cfg.onWarning(ctx, w)
		}
	}
}
