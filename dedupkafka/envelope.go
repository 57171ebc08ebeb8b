package dedupkafka

import (
	"errors"
	"strconv"
	"strings"

	"github.com/dedupkit/dedup/consumer"
	"github.com/twmb/franz-go/pkg/kgo"
)

// Header names of the envelope, the same as the other adapters use.
const (
	// HeaderMsgID carries the logical message ID: set once per logical
	// event by the producer and kept by every retry and replay.
	HeaderMsgID = "Dedup-Msg-Id"
	// HeaderBusinessKey carries the business key (consumer.WithBusinessKey).
	HeaderBusinessKey = "Dedup-Business-Key"
	// HeaderAggregate and HeaderVersion place the message in an
	// aggregate's history; the version is a decimal uint64.
	HeaderAggregate = "Dedup-Aggregate"
	HeaderVersion   = "Dedup-Version"
	// HeaderKafkaKey carries the record's key inside a [consumer.Message]
	// (which has no key field), so that a dead letter and its replay keep
	// it: [Publisher.Republish] sends it as the record key again, and the
	// record goes to the same partition.
	HeaderKafkaKey = "Dedup-Kafka-Key"
	// HeaderKafkaSource is "topic/partition/offset" of the record a
	// [consumer.Message] was read from, for dead letters and logs. A
	// republish drops it.
	HeaderKafkaSource = "Dedup-Kafka-Source"
)

// A HeaderError reports an envelope header whose value cannot be read. A
// consumer dead-letters such a record; the error is the reason.
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
	return "dedupkafka: malformed " + e.Header + " header " + strconv.Quote(v) + ": " + e.Err.Error()
}

// Unwrap returns the parse error.
func (e *HeaderError) Unwrap() error { return e.Err }

// sourceOf is "topic/partition/offset" of r: the key of a record without a
// message ID header. It catches redelivery of that record, not a producer
// re-sending the same event (which lands at another offset).
func sourceOf(r *kgo.Record) string {
	// Built in a stack buffer (a topic name is at most 249 bytes): one
	// allocation, the string, where concatenating the formatted numbers
	// made three.
	var buf [320]byte
	b := append(buf[:0], r.Topic...)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(r.Partition), 10)
	b = append(b, '/')
	b = strconv.AppendInt(b, r.Offset, 10)
	return string(b)
}

// newMessage reads r into the broker-neutral envelope; delivery counts this
// process's deliveries of the record (1 for the first). It always returns
// a message filled as far as possible; the error reports an envelope the
// consumer dead-letters.
func newMessage(r *kgo.Record, delivery int) (*consumer.Message, error) {
	m := &consumer.Message{
		Subject:   r.Topic,
		Payload:   r.Value,
		Delivery:  delivery,
		Published: r.Timestamp,
		Headers:   make(map[string]string, len(r.Headers)+2),
	}
	for _, h := range r.Headers {
		if _, ok := m.Headers[h.Key]; !ok {
			m.Headers[h.Key] = string(h.Value)
		}
	}
	src := sourceOf(r)
	m.Headers[HeaderKafkaSource] = src
	var key string // converted once for both places it goes
	if r.Key != nil {
		key = string(r.Key)
		m.Headers[HeaderKafkaKey] = key
	}
	m.ID = m.Headers[HeaderMsgID]
	if m.ID == "" {
		m.ID = src
	}
	m.BusinessKey = m.Headers[HeaderBusinessKey]
	m.Aggregate = m.Headers[HeaderAggregate]
	if m.Aggregate == "" && r.Key != nil {
		m.Aggregate = key
	}
	if v, ok := m.Headers[HeaderVersion]; ok {
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return m, &HeaderError{Header: HeaderVersion, Value: v, Err: errors.Unwrap(err)}
		}
		m.Version = n
	}
	return m, nil
}

// recordOf builds the record that publishes m again under its original
// IDs: the message ID as HeaderMsgID (also when it was derived from the
// source offset, so that the republished copy keeps the key it ran
// under), HeaderKafkaKey as the record key, every other header as is.
func recordOf(m *consumer.Message) *kgo.Record {
	r := &kgo.Record{Topic: m.Subject, Value: m.Payload}
	r.Headers = make([]kgo.RecordHeader, 0, len(m.Headers)+1)
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderMsgID, Value: []byte(m.ID)})
	for k, v := range m.Headers {
		switch k {
		case HeaderMsgID, HeaderKafkaSource:
			continue
		case HeaderKafkaKey:
			r.Key = []byte(v)
			continue
		}
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	if m.BusinessKey != "" && m.Headers[HeaderBusinessKey] == "" {
		r.Headers = append(r.Headers, kgo.RecordHeader{Key: HeaderBusinessKey, Value: []byte(m.BusinessKey)})
	}
	return r
}
