package dedupnats

import (
	"context"
	"errors"
	"strconv"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/outbox"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// OutboxPublisher is the [outbox.Publisher] for NATS JetStream: it
// publishes a relay's batch with asynchronous acknowledgements, in order
// on the JetStream context's connection, in the envelope a [Consumer]
// reads: the outbox message's ID as Dedup-Msg-Id and Nats-Msg-Id (so the
// stream's duplicate window drops a repeat of a relay's retry, and the
// consumer's dedup drops one sent after the window), its key as
// Dedup-Aggregate, a Dedup-Version header of the message's own kept. It is
// safe for concurrent use.
type OutboxPublisher struct {
	js      jetstream.JetStream
	p       *Publisher
	stream  string
	ackWait time.Duration
}

var _ outbox.Publisher = (*OutboxPublisher)(nil)

// NewOutboxPublisher returns an outbox publisher on js. Of the
// [PublisherOption]s, [WithExpectStream] applies (retries are the
// relay's). ackWait bounds the wait for a batch's acknowledgements
// (positive; 30s is a fair choice): a message unacknowledged by then is
// reported failed and published again later under the same ID.
func NewOutboxPublisher(js jetstream.JetStream, ackWait time.Duration, opts ...PublisherOption) (*OutboxPublisher, error) {
	p, err := NewPublisher(js, opts...)
	if err != nil {
		return nil, err
	}
	if ackWait <= 0 {
		return nil, bad("ack wait", "must be positive, got "+ackWait.String())
	}
	return &OutboxPublisher{js: js, p: p, stream: p.cfg.stream, ackWait: ackWait}, nil
}

// Publish implements [outbox.Publisher].
func (o *OutboxPublisher) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	var opts []jetstream.PublishOpt
	if o.stream != "" {
		opts = append(opts, jetstream.WithExpectStream(o.stream))
	}
	futures := make([]jetstream.PubAckFuture, len(batch))
	sent := 0
	for i := range batch {
		m := &batch[i]
		cm := consumer.Message{ID: m.ID, Aggregate: m.Key, Subject: m.Topic, Payload: m.Payload, Headers: m.Headers}
		if v := m.Headers[HeaderVersion]; v != "" {
			if n, err := strconv.ParseUint(v, 10, 64); err == nil {
				cm.Version = n
			}
		}
		msg, err := o.p.natsMsg("", &cm, false)
		if err == nil {
			msg.Header.Set(jetstream.MsgIDHeader, m.ID)
			futures[i], err = o.js.PublishMsgAsync(msg, opts...)
		}
		if err != nil {
			results[i] = classify(err)
			// Nothing after it is sent: a later message of its key must
			// not overtake it.
			for j := i + 1; j < len(batch); j++ {
				results[j] = outbox.ErrNotSent
			}
			break
		}
		sent = i + 1
	}
	timer := time.NewTimer(o.ackWait)
	defer timer.Stop()
	expired := false
	for i := 0; i < sent; i++ {
		f := futures[i]
		if expired {
			select {
			case <-f.Ok():
			case err := <-f.Err():
				results[i] = classify(err)
			default:
				results[i] = errors.New("dedupnats: no acknowledgement within the ack wait")
			}
			continue
		}
		select {
		case <-f.Ok():
		case err := <-f.Err():
			results[i] = classify(err)
		case <-ctx.Done():
			results[i] = ctx.Err()
			expired = true
		case <-timer.C:
			results[i] = errors.New("dedupnats: no acknowledgement within the ack wait")
			expired = true
		}
	}
}

// classify marks the errors a retry cannot cure as permanent.
func classify(err error) error {
	if errors.Is(err, nats.ErrMaxPayload) || errors.Is(err, nats.ErrBadSubject) || errors.Is(err, dedup.ErrInvalidArgument) {
		return outbox.Permanent(err)
	}
	return err
}
