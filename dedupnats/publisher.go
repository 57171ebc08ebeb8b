package dedupnats

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Publisher publishes messages in the envelope a [Consumer] reads. It is
// safe for concurrent use.
type Publisher struct {
	js  jetstream.JetStream
	cfg publisherConfig
}

var _ consumer.Republisher = (*Publisher)(nil)

// NewPublisher returns a publisher on js. A bad option gives a
// [*dedup.ArgumentError].
func NewPublisher(js jetstream.JetStream, opts ...PublisherOption) (*Publisher, error) {
	if js == nil {
		return nil, bad("jetstream", "is nil")
	}
	cfg := defaultPublisherConfig()
	for _, o := range opts {
		if o != nil {
			o.applyPublisher(&cfg)
		}
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Publisher{js: js, cfg: cfg}, nil
}

// Publish publishes m to subject (m.Subject when subject is empty) with
// m.ID as both Dedup-Msg-Id and Nats-Msg-Id, so the broker drops a repeat
// inside the stream's duplicate window (defence in depth; the consumer's
// dedup store is the guarantee), and with Dedup-Business-Key,
// Dedup-Aggregate and Dedup-Version when m has them. m.Headers are sent
// too; the envelope headers override theirs.
//
// duplicate reports that the broker already held a message under this
// Nats-Msg-Id (PubAck.Duplicate): an earlier publish of the same logical
// message, or an earlier attempt of this one whose acknowledgement was
// lost. Either way the message is in the stream once.
//
// m.ID must be set by the caller, once per logical event, and reused on
// every retry: Publish never invents one, since a random ID per attempt
// would defeat deduplication.
func (p *Publisher) Publish(ctx context.Context, subject string, m *consumer.Message) (duplicate bool, err error) {
	if m == nil {
		return false, bad("message", "is nil")
	}
	if err := validID(m.ID); err != nil {
		return false, err
	}
	msg, err := p.natsMsg(subject, m, false)
	if err != nil {
		return false, err
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID)
	ack, err := p.publish(ctx, msg)
	if err != nil {
		return false, err
	}
	return ack.Duplicate, nil
}

// Republish implements [consumer.Republisher] for [consumer.Replay]: it
// sends m back to m.Subject with its original Dedup-Msg-Id, business key
// and headers, so the consumer's dedup decides again (a message that
// completed meanwhile is a duplicate), but with a Nats-Msg-Id of its own
// ("<id>/replay/<random>"), so the broker's duplicate window does not
// swallow the replay of a message published moments ago. NATS control
// headers (Nats-*) of the original are not sent again.
func (p *Publisher) Republish(ctx context.Context, m *consumer.Message) error {
	if m == nil {
		return bad("message", "is nil")
	}
	if err := validID(m.ID); err != nil {
		return err
	}
	msg, err := p.natsMsg("", m, true)
	if err != nil {
		return err
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID+"/replay/"+dedup.NewToken().String())
	_, err = p.publish(ctx, msg)
	return err
}

func (p *Publisher) natsMsg(subject string, m *consumer.Message, replay bool) (*nats.Msg, error) {
	if subject == "" {
		subject = m.Subject
	}
	if subject == "" {
		return nil, bad("subject", "is empty and the message has none")
	}
	h := make(nats.Header, len(m.Headers)+5)
	for k, v := range m.Headers {
		if replay && strings.HasPrefix(k, "Nats-") {
			continue
		}
		if err := validHeader(k, v); err != nil {
			return nil, err
		}
		h.Set(k, v)
	}
	h.Set(HeaderMsgID, m.ID)
	set := func(name, v string) error {
		if v == "" {
			h.Del(name)
			return nil
		}
		if err := validHeader(name, v); err != nil {
			return err
		}
		h.Set(name, v)
		return nil
	}
	if err := set(HeaderBusinessKey, m.BusinessKey); err != nil {
		return nil, err
	}
	if err := set(HeaderAggregate, m.Aggregate); err != nil {
		return nil, err
	}
	if m.Version != 0 {
		h.Set(HeaderVersion, strconv.FormatUint(m.Version, 10))
	} else {
		h.Del(HeaderVersion)
	}
	return &nats.Msg{Subject: subject, Data: m.Payload, Header: h}, nil
}

// publish sends msg, retrying (with the same headers, so the same
// Nats-Msg-Id) while the outcome is unknown.
func (p *Publisher) publish(ctx context.Context, msg *nats.Msg) (*jetstream.PubAck, error) {
	var opts []jetstream.PublishOpt
	if p.cfg.stream != "" {
		opts = append(opts, jetstream.WithExpectStream(p.cfg.stream))
	}
	var last error
	for i := 0; i < p.cfg.attempts; i++ {
		if i > 0 {
			t := time.NewTimer(p.cfg.wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return nil, errors.Join(ctx.Err(), last)
			case <-t.C:
			}
		}
		ack, err := p.js.PublishMsg(ctx, msg, opts...)
		if err == nil {
			return ack, nil
		}
		last = err
		if !unknownOutcome(err) || ctx.Err() != nil {
			break
		}
	}
	return nil, &PublishError{Subject: msg.Subject, MsgID: msg.Header.Get(jetstream.MsgIDHeader), Err: last}
}

// A PublishError is a publish that failed. Unless the server answered
// with an error ([jetstream.APIError] in the chain), the message may have
// been stored: publish it again under the same ID, and the broker (inside
// its duplicate window) or the consumer's dedup drops the repeat.
type PublishError struct {
	Subject, MsgID string
	Err            error
}

func (e *PublishError) Error() string {
	return "dedupnats: publish " + e.MsgID + " to " + e.Subject + ": " + e.Err.Error()
}

// Unwrap returns the cause.
func (e *PublishError) Unwrap() error { return e.Err }

// unknownOutcome reports whether a publish error leaves open whether the
// message was stored: anything but a server's answer.
func unknownOutcome(err error) bool {
	var api *jetstream.APIError
	if errors.As(err, &api) {
		return false
	}
	return !errors.Is(err, nats.ErrConnectionClosed) && !errors.Is(err, nats.ErrBadSubject) &&
		!errors.Is(err, nats.ErrMaxPayload) && !errors.Is(err, jetstream.ErrInvalidOption)
}

func validID(id string) error {
	if err := (dedup.Key{Scope: "m", ID: id}).Validate(); err != nil {
		var ae *dedup.ArgumentError
		if errors.As(err, &ae) {
			return bad("message id", ae.Reason)
		}
		return err
	}
	return nil
}

// validHeader refuses a header that would break the NATS header block.
func validHeader(k, v string) error {
	if k == "" || strings.ContainsAny(k, ": \t\r\n") {
		return bad("header name", strconv.Quote(k)+" is not a header name")
	}
	if strings.ContainsAny(v, "\r\n") {
		return bad("header "+k, "has a line break")
	}
	return nil
}
