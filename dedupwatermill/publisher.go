package dedupwatermill

import (
	"context"
	"errors"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/dedupkit/dedup/outbox"
)

// Metadata fields the [OutboxPublisher] sets on every message.
const (
	// MetadataMessageID carries the outbox message's stable ID (also the
	// Watermill UUID, which some publishers do not transmit).
	MetadataMessageID = "dedup_message_id"
	// MetadataAggregate carries the outbox message's aggregate key.
	MetadataAggregate = "dedup_aggregate"
)

// OutboxPublisher is the [outbox.Publisher] that publishes a relay's
// batches through any Watermill message.Publisher (SQS, Google Pub/Sub,
// AMQP, Kafka, Redis Streams, SQL, gochannel...). Each outbox message
// becomes a Watermill message whose UUID is the outbox message's stable ID,
// with that ID in [MetadataMessageID] and the aggregate key in
// [MetadataAggregate], its headers as metadata, on the topic of the
// outbox message. A consumer keyed with [WithMetadataKey]([MetadataMessageID])
// (or on the UUID, when the transport carries it) absorbs the relay's
// retries.
//
// Watermill's Publish returns when the messages are published or failed,
// so each is sent synchronously, in batch order. A failure stops the
// batch there (every later message is reported [outbox.ErrNotSent]), which
// keeps each key's order. It is safe for concurrent use when pub is.
type OutboxPublisher struct {
	pub       message.Publisher
	permanent func(error) bool
}

var _ outbox.Publisher = (*OutboxPublisher)(nil)

// A PublisherOption configures an [OutboxPublisher].
type PublisherOption interface{ applyPub(*OutboxPublisher) }

type pubOption func(*OutboxPublisher)

func (f pubOption) applyPub(p *OutboxPublisher) { f(p) }

// WithPermanentErrors marks the publish errors for which f returns true
// as permanent ([outbox.Permanent]): the relay quarantines the row instead
// of retrying it. Use it only for errors a retry cannot cure (a message
// over the transport's size limit, a topic that cannot exist). Default:
// no error is permanent.
func WithPermanentErrors(f func(error) bool) PublisherOption {
	return pubOption(func(p *OutboxPublisher) { p.permanent = f })
}

// NewOutboxPublisher returns an outbox publisher on pub, or an
// [*dedup.ArgumentError] when pub is nil. It does not close pub.
func NewOutboxPublisher(pub message.Publisher, opts ...PublisherOption) (*OutboxPublisher, error) {
	if pub == nil {
		return nil, bad("publisher", "is nil")
	}
	p := &OutboxPublisher{pub: pub, permanent: func(error) bool { return false }}
	for _, o := range opts {
		o.applyPub(p)
	}
	if p.permanent == nil {
		return nil, bad("permanent error filter", "is nil")
	}
	return p, nil
}

// Message returns the Watermill message the publisher sends for m.
func Message(m *outbox.Message) *message.Message {
	wm := message.NewMessage(m.ID, m.Payload)
	for k, v := range m.Headers {
		wm.Metadata.Set(k, v)
	}
	wm.Metadata.Set(MetadataMessageID, m.ID)
	if m.Key != "" {
		wm.Metadata.Set(MetadataAggregate, m.Key)
	}
	return wm
}

// Publish implements [outbox.Publisher].
func (p *OutboxPublisher) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	for i := range batch {
		if ctx.Err() != nil {
			notSent(results[i:])
			return
		}
		wm := Message(&batch[i])
		wm.SetContext(ctx)
		if err := p.pub.Publish(batch[i].Topic, wm); err != nil {
			// It may have reached the transport (a timeout after the
			// send): the relay publishes it again under the same ID.
			if p.permanent(err) && !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) {
				err = outbox.Permanent(err)
			}
			results[i] = err
			notSent(results[i+1:])
			return
		}
	}
}

func notSent(results []error) {
	for i := range results {
		results[i] = outbox.ErrNotSent
	}
}
