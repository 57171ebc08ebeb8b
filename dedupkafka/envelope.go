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
	return string(appendSource(buf[:0], r))
}

// appendSource appends sourceOf(r) to b.
func appendSource(b []byte, r *kgo.Record) []byte {
	b = append(b, r.Topic...)
	b = append(b, '/')
	b = strconv.AppendInt(b, int64(r.Partition), 10)
	b = append(b, '/')
	return strconv.AppendInt(b, r.Offset, 10)
}

// newMessage reads r into the broker-neutral envelope; delivery counts this
// process's deliveries of the record (1 for the first). It always returns
// a message filled as far as possible; the error reports an envelope the
// consumer dead-letters.
//
// The named headers are picked out while the map is filled, not looked up
// after. The source and the record key share one allocation. Each header
// value keeps its own: a dedup store keeps the key's ID for the whole
// retention (memstore keeps the caller's string), and an ID cut from a
// shared string would keep all of it. For the same reason the source,
// when it is the ID, is copied out.
func newMessage(r *kgo.Record, delivery int) (*consumer.Message, error) {
	m := &consumer.Message{
		Subject:   r.Topic,
		Payload:   r.Value,
		Delivery:  delivery,
		Published: r.Timestamp,
		Headers:   make(map[string]string, len(r.Headers)+2),
	}
	var version string
	hasVersion := false
	for _, h := range r.Headers {
		if _, ok := m.Headers[h.Key]; ok {
			continue // the first value counts
		}
		v := string(h.Value)
		m.Headers[h.Key] = v
		switch h.Key {
		case HeaderMsgID:
			m.ID = v
		case HeaderBusinessKey:
			m.BusinessKey = v
		case HeaderAggregate:
			m.Aggregate = v
		case HeaderVersion:
			version, hasVersion = v, true
		}
	}
	// The source and the key, built in a stack buffer (a topic name is at
	// most 249 bytes) when the key is short.
	var buf [320]byte
	b := appendSource(buf[:0], r)
	srcEnd := len(b)
	text := string(append(b, r.Key...))
	src := text[:srcEnd]
	m.Headers[HeaderKafkaSource] = src
	if r.Key != nil {
		key := text[srcEnd:]
		m.Headers[HeaderKafkaKey] = key
		if m.Aggregate == "" {
			m.Aggregate = key
		}
	}
	if m.ID == "" {
		m.ID = src
		if r.Key != nil {
			m.ID = strings.Clone(src) // the store keeps the ID: not the key with it
		}
	}
	if hasVersion {
		n, err := strconv.ParseUint(strings.TrimSpace(version), 10, 64)
		if err != nil {
			return m, &HeaderError{Header: HeaderVersion, Value: version, Err: errors.Unwrap(err)}
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
