package dedupamqp

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Headers of a dead-letter record, beside the original message's own.
const (
	HeaderDLID           = "Dedup-DL-Id"
	HeaderDLConsumer     = "Dedup-DL-Consumer"
	HeaderDLKeyScope     = "Dedup-DL-Key-Scope"
	HeaderDLKeyID        = "Dedup-DL-Key-Id"
	HeaderDLClass        = "Dedup-DL-Class"
	HeaderDLReason       = "Dedup-DL-Reason"
	HeaderDLAttempts     = "Dedup-DL-Attempts"
	HeaderDLFirstFailure = "Dedup-DL-First-Failure"
	HeaderDLLastFailure  = "Dedup-DL-Last-Failure"
	HeaderDLQueue        = "Dedup-DL-Queue"
)

// DLQ is a dead-letter exchange and its queue: a
// [consumer.DeadLetterStore] on RabbitMQ. A record is the original
// message, body and headers unchanged and message_id kept, plus the
// Dedup-DL-* headers with the failure (consumer, key, class, reason,
// attempts, failure times). Messages the broker dead-letters by itself
// to the same exchange (a quorum queue's delivery limit, a rejection)
// are records too: their reason comes from the broker's x-death header
// and their key is the message_id under the scope given to [NewDLQ].
//
// RabbitMQ cannot read a queue without taking messages off it: List, Get
// and Delete take every record with basic.get, unacknowledged, and close
// the channel to put back all but a deleted one, so they cost one pass
// over the queue. That suits a dead-letter queue (few records, read by an
// operator or a replay); the queue is classic, so that reading does not
// count towards a delivery limit. It is safe for concurrent use.
type DLQ struct {
	name  string
	scope string
	pub   *Publisher
	url   string
	dial  amqp.Config

	mu sync.Mutex // one reading pass at a time
}

var _ consumer.DeadLetterStore = (*DLQ)(nil)

// NewDLQ declares the fanout exchange name and the durable classic queue
// name bound to it, and returns the store over them. scope is the dedup
// key scope of records the broker dead-lettered by itself (the consumer's
// scope, by default its name); "" leaves their key empty. A bad argument
// gives a [*dedup.ArgumentError].
func NewDLQ(ctx context.Context, url, name, scope string) (*DLQ, error) {
	if !validName(name, false) {
		return nil, bad("dead-letter exchange", strconv.Quote(name)+" is not an exchange name")
	}
	pub, err := NewPublisher(url, WithExchange(name))
	if err != nil {
		return nil, err
	}
	q := &DLQ{name: name, scope: scope, pub: pub, url: url}
	err = q.with(ctx, func(ch *amqp.Channel) error {
		if err := ch.ExchangeDeclare(name, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueueDeclare(name, true, false, false, false, amqp.Table{amqp.QueueTypeArg: Classic}); err != nil {
			return err
		}
		return ch.QueueBind(name, "", name, false, nil)
	})
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("dedupamqp: declare dead-letter exchange and queue %s: %w", name, err)
	}
	return q, nil
}

// OpenDLQ opens the dead-letter queue name, which must exist (written by
// a [DLQ] made with [NewDLQ]); it declares nothing. It is what the `dedup
// dlq` command uses, so that a mistyped name is an error rather than a new
// empty queue.
func OpenDLQ(ctx context.Context, url, name, scope string) (*DLQ, error) {
	if !validName(name, false) {
		return nil, bad("dead-letter queue", strconv.Quote(name)+" is not a queue name")
	}
	pub, err := NewPublisher(url, WithExchange(name))
	if err != nil {
		return nil, err
	}
	q := &DLQ{name: name, scope: scope, pub: pub, url: url}
	err = q.with(ctx, func(ch *amqp.Channel) error {
		_, err := ch.QueueDeclarePassive(name, true, false, false, false, nil)
		return err
	})
	if err != nil {
		pub.Close()
		return nil, fmt.Errorf("dedupamqp: no dead-letter queue %s: %w", name, err)
	}
	return q, nil
}

// Exchange returns the dead-letter exchange, for [WithDeadLetterExchange].
func (q *DLQ) Exchange() string { return q.name }

// Queue returns the dead-letter queue.
func (q *DLQ) Queue() string { return q.name }

// Close closes the store's connection.
func (q *DLQ) Close() error { return q.pub.Close() }

// with runs f on a fresh channel of a fresh connection, closed after.
func (q *DLQ) with(ctx context.Context, f func(ch *amqp.Channel) error) error {
	conn, err := dial(ctx, q.url, q.dial)
	if err != nil {
		return err
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	return f(ch)
}

// DeadLetter implements [consumer.DeadLetterSink]: it publishes the
// record and returns once the broker confirmed it.
func (q *DLQ) DeadLetter(ctx context.Context, dl consumer.DeadLetter) error {
	m := &dl.Message
	msg := publishing(m)
	if msg.Headers == nil {
		msg.Headers = amqp.Table{}
	}
	var rnd [4]byte
	_, _ = rand.Read(rnd[:])
	msg.Headers[HeaderDLID] = fmt.Sprintf("%016x-%s", time.Now().UnixNano(), hex.EncodeToString(rnd[:]))
	msg.Headers[HeaderDLConsumer] = dl.Consumer
	msg.Headers[HeaderDLKeyScope] = dl.Key.Scope
	msg.Headers[HeaderDLKeyID] = dl.Key.ID
	msg.Headers[HeaderDLClass] = dl.Class.String()
	msg.Headers[HeaderDLReason] = dl.Reason
	msg.Headers[HeaderDLAttempts] = int64(dl.Attempts)
	msg.Headers[HeaderDLFirstFailure] = dl.FirstFailure.UTC().Format(time.RFC3339Nano)
	msg.Headers[HeaderDLLastFailure] = dl.LastFailure.UTC().Format(time.RFC3339Nano)
	msg.Headers[HeaderDLQueue] = m.Subject
	if err := q.pub.publish(ctx, q.name, dl.Consumer, msg); err != nil {
		return fmt.Errorf("dedupamqp: write dead letter to %s: %w", q.name, err)
	}
	return nil
}

// scan takes every record off the queue on a fresh channel, calls f with
// each (in queue order) and closes the channel, which puts back every
// record not acknowledged by f.
func (q *DLQ) scan(ctx context.Context, f func(d *amqp.Delivery, dl consumer.DeadLetter) (stop bool, err error)) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.with(ctx, func(ch *amqp.Channel) error {
		for ctx.Err() == nil {
			d, ok, err := ch.Get(q.name, false)
			if err != nil {
				return err
			}
			if !ok {
				return nil
			}
			stop, err := f(&d, q.record(&d))
			if err != nil || stop {
				return err
			}
		}
		return ctx.Err()
	})
}

// record decodes a delivery of the dead-letter queue.
func (q *DLQ) record(d *amqp.Delivery) consumer.DeadLetter {
	m, _ := newMessage(d, "")
	h := func(k string) string { s, _ := headerString(d.Headers[k]); return s }
	dl := consumer.DeadLetter{ID: h(HeaderDLID), Consumer: h(HeaderDLConsumer), Reason: h(HeaderDLReason)}
	if dl.ID != "" {
		dl.Key = dedup.Key{Scope: h(HeaderDLKeyScope), ID: h(HeaderDLKeyID)}
		dl.Class = parseClass(h(HeaderDLClass))
		dl.Attempts, _ = headerInt(d.Headers[HeaderDLAttempts])
		dl.FirstFailure, _ = time.Parse(time.RFC3339Nano, h(HeaderDLFirstFailure))
		dl.LastFailure, _ = time.Parse(time.RFC3339Nano, h(HeaderDLLastFailure))
		m.Subject = h(HeaderDLQueue)
		for k := range m.Headers {
			if strings.HasPrefix(k, "Dedup-DL-") {
				delete(m.Headers, k)
			}
		}
	} else {
		// Dead-lettered by the broker: x-death says from where and why.
		var first time.Time
		reason, queue := "", ""
		if deaths, ok := d.Headers["x-death"].([]any); ok && len(deaths) > 0 {
			if t, ok := deaths[len(deaths)-1].(amqp.Table); ok {
				reason, _ = headerString(t["reason"])
				queue, _ = headerString(t["queue"])
				if ts, ok := t["time"].(time.Time); ok {
					first = ts
				}
			}
		}
		sum := sha256.Sum256([]byte(d.MessageId + "\x00" + queue + "\x00" + first.String()))
		dl.ID = fmt.Sprintf("%016x-b%s", first.UnixNano(), hex.EncodeToString(sum[:4]))
		dl.Class = consumer.ClassPermanent
		dl.Reason = "dead-lettered by the broker: " + reason + " (queue " + queue + ")"
		dl.FirstFailure, dl.LastFailure = first, first
		m.Subject = queue
		if q.scope != "" && d.MessageId != "" {
			dl.Key = dedup.Key{Scope: q.scope, ID: d.MessageId}
		}
	}
	dl.Message = *m
	return dl
}

func parseClass(s string) consumer.Class {
	for c := consumer.Unclassified; c <= consumer.ClassUnknown; c++ {
		if c.String() == s {
			return c
		}
	}
	return consumer.Unclassified
}

// List implements [consumer.DeadLetterStore]: up to limit records (all
// when limit <= 0) with IDs after the given one, in ID order, which is
// the order they were written in.
func (q *DLQ) List(ctx context.Context, after string, limit int) ([]consumer.DeadLetter, error) {
	var out []consumer.DeadLetter
	err := q.scan(ctx, func(_ *amqp.Delivery, dl consumer.DeadLetter) (bool, error) {
		if dl.ID > after {
			out = append(out, dl)
		}
		return false, nil
	})
	if err != nil {
		return nil, fmt.Errorf("dedupamqp: list dead letters in %s: %w", q.name, err)
	}
	slices.SortFunc(out, func(a, b consumer.DeadLetter) int { return strings.Compare(a.ID, b.ID) })
	if limit > 0 && len(out) > limit {
		out = out[:limit]
	}
	return out, nil
}

// Get implements [consumer.DeadLetterStore].
func (q *DLQ) Get(ctx context.Context, id string) (consumer.DeadLetter, error) {
	var found *consumer.DeadLetter
	err := q.scan(ctx, func(_ *amqp.Delivery, dl consumer.DeadLetter) (bool, error) {
		if dl.ID == id {
			found = &dl
			return true, nil
		}
		return false, nil
	})
	if err != nil {
		return consumer.DeadLetter{}, fmt.Errorf("dedupamqp: get dead letter %s: %w", id, err)
	}
	if found == nil {
		return consumer.DeadLetter{}, consumer.ErrNotFound
	}
	return *found, nil
}

// Delete implements [consumer.DeadLetterStore]: it acknowledges the
// record off the queue. Deleting a missing record is not an error.
func (q *DLQ) Delete(ctx context.Context, id string) error {
	err := q.scan(ctx, func(d *amqp.Delivery, dl consumer.DeadLetter) (bool, error) {
		if dl.ID == id {
			return true, d.Ack(false)
		}
		return false, nil
	})
	if err != nil && !errors.Is(err, consumer.ErrNotFound) {
		return fmt.Errorf("dedupamqp: delete dead letter %s: %w", id, err)
	}
	return nil
}
