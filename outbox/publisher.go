package outbox

import (
	"context"
	"errors"
)

// A Publisher sends batches of outbox messages to a broker. Broker
// adapters implement it (dedupnats.OutboxPublisher for NATS JetStream;
// RabbitMQ, Kafka and Watermill adapters implement the same interface).
//
// Publish sends batch to the broker in slice order, with as many messages
// in flight as the adapter likes (asynchronous acknowledgements: the
// relay's throughput comes from not waiting for each one), and returns
// only when every message has an outcome or ctx is done. It records the
// outcome of batch[i] in results[i], which the relay passes zeroed and
// of the same length as batch:
//
//   - nil: the broker acknowledged the message durably (a JetStream
//     PubAck, a RabbitMQ publisher confirm, a Kafka produce response with
//     acks=all). A broker-side duplicate (the broker already held a
//     message with this ID) is an acknowledgement too.
//   - an error: the message is not known to be stored. The relay publishes
//     it again later under the same ID, unless the error is permanent
//     ([IsPermanent]): then the relay quarantines the row without
//     retrying. An adapter must wrap an error with [Permanent] only when
//     a retry cannot succeed (the broker rejected this message itself:
//     too large, no such topic, refused by policy); a timeout, a closed
//     connection or a cancelled ctx is never permanent.
//   - [ErrNotSent] for a message the adapter did not attempt (it stopped
//     early: ctx done, connection lost).
//
// The adapter must send batch[i].ID as the broker's deduplication header
// on every attempt (Nats-Msg-Id, message-id, a Kafka header) and never
// invent an ID. Messages of one Key must reach the broker in slice order
// (one ordered connection or channel per batch is enough), and once the
// send of a message fails (an error before it left, such as a payload
// over the broker's limit) no later message of its Key may be sent in
// that call: report them [ErrNotSent] (the NATS adapter stops the whole
// batch there). The relay marks as published only the acknowledged
// prefix of each Key's messages and sends the rest again, so each Key's
// order holds at the broker, except when the broker rejects a message
// asynchronously after it accepted the connection's later ones: then
// the later ones of that Key were stored first (docs/DESIGN.md,
// "Outbox relay").
//
// Publish must not retain batch, its payloads or results after it
// returns. It is called by one goroutine per partition; an adapter shared
// between partitions must be safe for concurrent use.
type Publisher interface {
	Publish(ctx context.Context, batch []Message, results []error)
}

// ErrNotSent is the outcome of a message a [Publisher] did not attempt.
var ErrNotSent = errors.New("outbox: message not sent")

// ErrLeaseLost is returned when a relay's lease on a partition ended (it
// expired and another relay took the partition over): the relay must not
// mark rows of that partition and stops working on it.
var ErrLeaseLost = errors.New("outbox: partition lease lost")

// ErrPartitionMismatch is returned by [Source.Join] when relays with
// another partition count are alive on the same outbox: the relay stops
// rather than break per-key order.
var ErrPartitionMismatch = errors.New("outbox: relays with another partition count are alive")

// Permanent wraps err to say that publishing the message again cannot
// succeed: the relay quarantines the row at once instead of retrying it.
// Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

type permanentError struct{ err error }

func (e *permanentError) Error() string   { return "permanent: " + e.err.Error() }
func (e *permanentError) Unwrap() error   { return e.err }
func (e *permanentError) Permanent() bool { return true }

// IsPermanent reports whether err, or an error it wraps, has a
// Permanent() bool method that returns true (errors made by [Permanent],
// or an adapter's own typed errors).
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
