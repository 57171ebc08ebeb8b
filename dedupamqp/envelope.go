package dedupamqp

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/dedupkit/dedup/consumer"
	amqp "github.com/rabbitmq/amqp091-go"
)

// Header names of the envelope. The message ID itself travels in the AMQP
// message_id property.
const (
	// HeaderBusinessKey carries the business key (consumer.WithBusinessKey).
	HeaderBusinessKey = "Dedup-Business-Key"
	// HeaderAggregate and HeaderVersion place the message in an
	// aggregate's history; the version is a decimal uint64.
	HeaderAggregate = "Dedup-Aggregate"
	HeaderVersion   = "Dedup-Version"
	// HeaderRetries counts the adapter's delayed retries of a message: a
	// retry is a copy sent through a retry queue, which the broker counts
	// as a new message.
	HeaderRetries = "Dedup-Retries"
	// HeaderDeliveryCount is the quorum queue's count of earlier
	// deliveries that were returned to the queue.
	HeaderDeliveryCount = "x-delivery-count"
)

// ErrNoMessageID is the reason a message without a message_id is
// dead-lettered: with no stable ID there is nothing to deduplicate by.
var ErrNoMessageID = errors.New("dedupamqp: message has no message_id (publish every message with a stable MessageId)")

// A HeaderError reports an envelope header whose value cannot be read.
// A consumer dead-letters such a message; the error is the reason.
type HeaderError struct {
	Header string
	Value  string
	Err    error
}

func (e *HeaderError) Error() string {
	v := e.Value
	if len(v) > 64 {
		v = v[:64] + "..."
	}
	return "dedupamqp: malformed " + e.Header + " header " + strconv.Quote(v) + ": " + e.Err.Error()
}

// Unwrap returns the parse error.
func (e *HeaderError) Unwrap() error { return e.Err }

// newMessage reads d, delivered from queue, into the broker-neutral
// envelope. It always returns a message filled as far as possible; the
// error reports an envelope the consumer must dead-letter.
func newMessage(d *amqp.Delivery, queue string) (*consumer.Message, error) {
	m := &consumer.Message{
		ID:        d.MessageId,
		Subject:   queue,
		Payload:   d.Body,
		Published: d.Timestamp,
	}
	if len(d.Headers) > 0 {
		m.Headers = make(map[string]string, len(d.Headers))
		for k, v := range d.Headers {
			if s, ok := headerString(v); ok {
				m.Headers[k] = s
			}
		}
	}
	if d.ContentType != "" {
		if m.Headers == nil {
			m.Headers = map[string]string{}
		}
		m.Headers[propContentType] = d.ContentType
	}
	m.BusinessKey = m.Headers[HeaderBusinessKey]
	m.Aggregate = m.Headers[HeaderAggregate]
	earlier := 0
	if n, ok := headerInt(d.Headers[HeaderDeliveryCount]); ok {
		earlier = n
	} else if d.Redelivered {
		earlier = 1
	}
	retries := 0
	if v, ok := d.Headers[HeaderRetries]; ok {
		n, ok := headerInt(v)
		if !ok {
			return m, &HeaderError{Header: HeaderRetries, Value: fmt.Sprint(v), Err: errors.New("not a count")}
		}
		retries = n
	}
	m.Delivery = int(min(int64(1)+int64(earlier)+int64(retries), 1<<31-1))
	if m.ID == "" {
		return m, ErrNoMessageID
	}
	if v := strings.TrimSpace(m.Headers[HeaderVersion]); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return m, &HeaderError{Header: HeaderVersion, Value: v, Err: err}
		}
		m.Version = n
	}
	return m, nil
}

// propContentType keeps the content_type property in Message.Headers, so
// a replay publishes it again.
const propContentType = "Dedup-Content-Type"

// headerString renders a header value that is a string or a number.
func headerString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	case int8, int16, int32, int64, int, uint8, uint16, uint32, uint64:
		return fmt.Sprint(x), true
	case bool:
		return strconv.FormatBool(x), true
	}
	return "", false
}

// headerInt reads a non-negative count from a header value of any
// integer type, or from a decimal string.
func headerInt(v any) (int, bool) {
	var n int64
	switch x := v.(type) {
	case int8:
		n = int64(x)
	case int16:
		n = int64(x)
	case int32:
		n = int64(x)
	case int64:
		n = x
	case int:
		n = int64(x)
	case uint8:
		n = int64(x)
	case uint16:
		n = int64(x)
	case uint32:
		n = int64(x)
	case string:
		p, err := strconv.ParseInt(strings.TrimSpace(x), 10, 64)
		if err != nil {
			return 0, false
		}
		n = p
	default:
		return 0, false
	}
	if n < 0 {
		return 0, false
	}
	return int(min(n, 1<<31-1)), true
}

// publishing turns m into an AMQP publishing under its own message ID,
// persistent, with its headers (the content type back in its property).
func publishing(m *consumer.Message) amqp.Publishing {
	p := amqp.Publishing{
		MessageId:    m.ID,
		DeliveryMode: amqp.Persistent,
		Body:         m.Payload,
		Timestamp:    m.Published,
	}
	if len(m.Headers) > 0 || m.BusinessKey != "" || m.Aggregate != "" || m.Version != 0 {
		p.Headers = make(amqp.Table, len(m.Headers)+3)
		for k, v := range m.Headers {
			switch k {
			case propContentType:
				p.ContentType = v
			case HeaderDeliveryCount, HeaderRetries, "x-death", "x-first-death-exchange", "x-first-death-queue", "x-first-death-reason":
				// The broker's and the adapter's delivery bookkeeping: a
				// replay or a new publish starts them again.
			default:
				p.Headers[k] = v
			}
		}
		if m.BusinessKey != "" {
			p.Headers[HeaderBusinessKey] = m.BusinessKey
		}
		if m.Aggregate != "" {
			p.Headers[HeaderAggregate] = m.Aggregate
		}
		if m.Version != 0 {
			p.Headers[HeaderVersion] = strconv.FormatUint(m.Version, 10)
		}
	}
	return p
}
