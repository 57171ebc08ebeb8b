package dedupkafka

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/outbox"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
)

type publisherConfig struct {
	delivery time.Duration
	kopts    []kgo.Opt
}

// A PublisherOption configures a [Publisher].
type PublisherOption interface{ applyPublisher(*publisherConfig) }

type publisherOption func(*publisherConfig)

func (f publisherOption) applyPublisher(c *publisherConfig) { f(c) }

// WithDeliveryTimeout bounds how long a record may wait for its produce
// response, retries included (kgo.RecordDeliveryTimeout); a record past it
// fails with an error that is not permanent, and the relay sends it again
// under the same ID. Default 30s.
func WithDeliveryTimeout(d time.Duration) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.delivery = d })
}

// WithProducerOptions adds franz-go options to the publisher's client
// (TLS, SASL, linger, compression, a partitioner). Options that would
// weaken the guarantees are refused by [NewPublisher]: it checks that the
// client stays idempotent with acks=all. Default none, except that the
// publisher's client lingers 0 (kgo.ProducerLinger(0), not franz-go's
// 10ms): its callers wait for each batch, so a linger only delays it; a
// kgo.ProducerLinger passed here overrides that.
func WithProducerOptions(opts ...kgo.Opt) PublisherOption {
	return publisherOption(func(c *publisherConfig) { c.kopts = append(c.kopts, opts...) })
}

// Publisher produces messages with franz-go's idempotent producer and
// acks=all: a produce retried inside the client after a lost response is
// written once (the broker drops the repeat by producer ID and sequence),
// and a message is acknowledged only once every in-sync replica has it.
// Each record carries the message ID as the Dedup-Msg-Id header, so a
// re-send from outside the client (the outbox relay after a crash, a
// replay) is a duplicate the consumer's dedup absorbs. It is safe for
// concurrent use.
type Publisher struct {
	cl        *kgo.Client
	closeOnce sync.Once
}

// NewPublisher returns a publisher on the brokers ("host:port" seeds). It
// refuses options that disable idempotence or lower the acks.
func NewPublisher(brokers []string, opts ...PublisherOption) (*Publisher, error) {
	if len(brokers) == 0 {
		return nil, bad("brokers", "needs at least one seed broker")
	}
	cfg := publisherConfig{delivery: 30 * time.Second}
	for _, o := range opts {
		o.applyPublisher(&cfg)
	}
	if cfg.delivery <= 0 {
		return nil, bad("delivery timeout", "must be positive, got "+cfg.delivery.String())
	}
	// Linger 0 before the caller's options (a later option wins): a
	// publisher's callers hand over whole batches and wait for them, so
	// franz-go's default linger (10ms) would only delay each batch; with
	// one produce request in flight per broker, the records buffered
	// meanwhile still go out together in the next one.
	kopts := append([]kgo.Opt{kgo.ProducerLinger(0)}, cfg.kopts...)
	kopts = append(kopts, kgo.SeedBrokers(brokers...), kgo.RecordDeliveryTimeout(cfg.delivery))
	cl, err := kgo.NewClient(kopts...)
	if err != nil {
		return nil, fmt.Errorf("dedupkafka: new producer: %w", err)
	}
	if v, _ := cl.OptValue(kgo.DisableIdempotentWrite).(bool); v {
		cl.Close()
		return nil, bad("producer options", "must not disable idempotent writes")
	}
	if acks, ok := cl.OptValue(kgo.RequiredAcks).(kgo.Acks); ok && acks != kgo.AllISRAcks() {
		cl.Close()
		return nil, bad("producer options", "must keep acks=all")
	}
	return &Publisher{cl: cl}, nil
}

// Client returns the franz-go client, for metrics.
func (p *Publisher) Client() *kgo.Client { return p.cl }

// Close flushes nothing and closes the client: call it after the last
// Publish has returned.
func (p *Publisher) Close() error {
	p.closeOnce.Do(p.cl.Close)
	return nil
}

// A ProduceError is the failure of one record.
type ProduceError struct {
	Topic string
	ID    string
	Err   error
}

func (e *ProduceError) Error() string {
	return "dedupkafka: produce " + strconv.Quote(e.ID) + " to " + e.Topic + ": " + e.Err.Error()
}

// Unwrap returns the client's error.
func (e *ProduceError) Unwrap() error { return e.Err }

// Permanent reports whether sending the record again cannot succeed: the
// broker refused this record itself (too large, no such topic, invalid
// topic, not authorized, a corrupt record). A timeout, a lost connection
// or a cancelled context is never permanent.
func (e *ProduceError) Permanent() bool {
	for _, k := range []*kerr.Error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidTopicException,
		kerr.TopicAuthorizationFailed, kerr.InvalidRecord, kerr.CorruptMessage, kerr.UnknownTopicOrPartition} {
		if errors.Is(e.Err, k) {
			return true
		}
	}
	return false
}

// Publish produces m to topic under its ID and waits for the broker's
// acknowledgement.
func (p *Publisher) Publish(ctx context.Context, topic string, m *consumer.Message) error {
	if m == nil {
		return bad("message", "is nil")
	}
	if m.ID == "" {
		return bad("message", "has no ID: every message needs a stable ID")
	}
	if !validTopic(topic) {
		return bad("topic", strconv.Quote(topic)+" is not a topic name")
	}
	r := recordOf(m)
	r.Topic = topic
	if err := p.cl.ProduceSync(ctx, r).FirstErr(); err != nil {
		return &ProduceError{Topic: topic, ID: m.ID, Err: err}
	}
	return nil
}

// Republish implements [consumer.Republisher]: m goes back to its topic
// (m.Subject) with its original message ID, record key and headers, so
// the consumer's dedup decides again.
func (p *Publisher) Republish(ctx context.Context, m *consumer.Message) error {
	if m == nil {
		return bad("message", "is nil")
	}
	return p.Publish(ctx, m.Subject, m)
}

// Outbox returns the publisher as an outbox relay's [outbox.Publisher]:
// each message goes to its Topic with its Key as the record key (so one
// aggregate's messages share a partition, in order), its ID as the
// Dedup-Msg-Id header and its Key as Dedup-Aggregate.
func (p *Publisher) Outbox() outbox.Publisher { return outboxPublisher{p} }

type outboxPublisher struct{ p *Publisher }

// Publish implements [outbox.Publisher]: the whole batch is handed to the
// client in order (the idempotent producer keeps each partition's order
// across its own retries), then every produce response is awaited. A
// record is reported acknowledged only when its response said so.
//
// The batch's records, their headers and the bytes of their keys and IDs
// are each allocated once for the whole batch (the record key and the
// Dedup-Aggregate header share their bytes; franz-go does not modify
// them), so that a record costs the client's own work and one callback.
func (o outboxPublisher) Publish(ctx context.Context, batch []outbox.Message, results []error) {
	nh, nb := 0, 0
	for i := range batch {
		m := &batch[i]
		nh += 2 + len(m.Headers)
		nb += len(m.ID) + len(m.Key)
		for k, v := range m.Headers {
			if k != HeaderMsgID && k != HeaderAggregate {
				nb += len(v)
			}
		}
	}
	recs := make([]kgo.Record, len(batch))
	hdrs := make([]kgo.RecordHeader, 0, nh)
	buf := make([]byte, 0, nb)
	bytesOf := func(s string) []byte {
		at := len(buf)
		buf = append(buf, s...)
		return buf[at:len(buf):len(buf)]
	}
	st := &publishWait{batch: batch, results: results, done: make(chan struct{})}
	var failed map[string]bool // keys whose send failed before it left
	st.left.Store(1)           // this goroutine's hold, dropped after the last Produce
	for i := range batch {
		m := &batch[i]
		if failed[m.Key] {
			results[i] = outbox.ErrNotSent
			continue
		}
		if !validTopic(m.Topic) {
			results[i] = outbox.Permanent(bad("topic", strconv.Quote(m.Topic)+" is not a topic name"))
			if failed == nil {
				failed = map[string]bool{}
			}
			failed[m.Key] = true
			continue
		}
		r := &recs[i]
		r.Topic, r.Value = m.Topic, m.Payload
		at := len(hdrs)
		hdrs = append(hdrs, kgo.RecordHeader{Key: HeaderMsgID, Value: bytesOf(m.ID)})
		if m.Key != "" {
			r.Key = bytesOf(m.Key)
			hdrs = append(hdrs, kgo.RecordHeader{Key: HeaderAggregate, Value: r.Key})
		} else {
			r.Key = []byte{}
		}
		for k, v := range m.Headers {
			if k != HeaderMsgID && k != HeaderAggregate {
				hdrs = append(hdrs, kgo.RecordHeader{Key: k, Value: bytesOf(v)})
			}
		}
		r.Headers = hdrs[at:len(hdrs):len(hdrs)]
		st.left.Add(1)
		o.p.cl.Produce(ctx, r, func(_ *kgo.Record, err error) { st.finish(i, err) })
	}
	st.finish(-1, nil)
	<-st.done
}

// publishWait collects a batch's produce outcomes; done is closed when
// the last one arrived.
type publishWait struct {
	batch   []outbox.Message
	results []error
	left    atomic.Int64
	done    chan struct{}
}

// finish records the outcome of batch[i] (i < 0: the producing
// goroutine's own hold) and closes done after the last one.
func (w *publishWait) finish(i int, err error) {
	if i >= 0 && err != nil {
		pe := &ProduceError{Topic: w.batch[i].Topic, ID: w.batch[i].ID, Err: err}
		if pe.Permanent() {
			w.results[i] = outbox.Permanent(pe)
		} else {
			w.results[i] = pe
		}
	}
	if w.left.Add(-1) == 0 {
		close(w.done)
	}
}
