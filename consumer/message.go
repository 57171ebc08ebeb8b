package consumer

import (
	"context"
	"time"

	"github.com/dedupkit/dedup"
)

// A Message is one delivery of a broker message, in a broker-neutral
// envelope. Adapters fill it from the broker's own message.
type Message struct {
	// ID is the logical message ID, stable across redeliveries and
	// republishes (Nats-Msg-Id, AMQP message_id, a Kafka header): the
	// default dedup key.
	ID string
	// BusinessKey optionally names the business request (an order number, a
	// payment reference), for dedup of one request sent under several
	// message IDs (see [WithBusinessKey]).
	BusinessKey string
	// Aggregate and Version optionally place the message in an aggregate's
	// ordered history, for version guards (package guard).
	Aggregate string
	Version   uint64
	// Subject is where the message was published: a subject, a topic or a
	// routing key. Replay publishes there again.
	Subject string
	// Payload is the body. The processor never logs it.
	Payload []byte
	// Headers are the message headers, first value per name.
	Headers map[string]string
	// Delivery counts deliveries of this message by the broker, 1 for the
	// first; 0 when the broker does not say.
	Delivery int
	// Published is when the broker accepted the message; zero when unknown.
	Published time.Time
}

// Clone returns a deep copy of m.
func (m *Message) Clone() Message {
	c := *m
	c.Payload = append([]byte(nil), m.Payload...)
	if m.Headers != nil {
		c.Headers = make(map[string]string, len(m.Headers))
		for k, v := range m.Headers {
			c.Headers[k] = v
		}
	}
	return c
}

// A Handler applies one message. It returns the result to store with the
// dedup record (given to duplicates; may be nil) or an error, classified
// with [Transient], [Permanent], [Reject] or [Unknown]. Delivery tells it
// the key it runs under and whether it took over a crashed attempt.
type Handler func(ctx context.Context, m *Message, d Delivery) ([]byte, error)

// Delivery is what the processor tells a handler about the current
// attempt.
type Delivery struct {
	// Key is the dedup key of the message: use it as the idempotency key
	// of any external call the handler makes (a payment provider's
	// Idempotency-Key), so a retry after an unknown outcome is safe there
	// too.
	Key dedup.Key
	// Attempt counts the processor's attempts at this key in this process,
	// 1 for the first.
	Attempt int
	// TakenOver is set when an earlier attempt held the key and did not
	// finish (a crash or an unknown outcome whose reconcile failed): its
	// effect may have happened. If a reconciler is set it has already
	// answered "not applied" by the time the handler runs.
	TakenOver bool
}

// Reconciled is a reconciler's answer.
type Reconciled struct {
	// Applied reports that the effect did happen: the processor records the
	// message as done with Result and acknowledges it without running the
	// handler again.
	Applied bool
	Result  []byte
}

// A Reconciler finds out whether the effect of key happened, typically by
// looking it up at the external provider under the stable key. An error
// means it could not tell: the processor retries later and asks again.
type Reconciler func(ctx context.Context, key dedup.Key, m *Message) (Reconciled, error)
