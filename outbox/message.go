package outbox

import (
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/dedupkit/dedup"
)

// Limits of a [Message], checked by [Message.Validate] before any I/O.
const (
	MaxIDLen       = 200     // bytes of Message.ID
	MaxTopicLen    = 255     // bytes of Message.Topic
	MaxKeyLen      = 1024    // bytes of Message.Key
	MaxHeaderLen   = 8 << 10 // bytes of one header's name plus value
	MaxHeaders     = 64      // number of Message.Headers
	MaxPayloadSize = 8 << 20 // bytes of Message.Payload
)

// A Message is one outgoing event, written to an outbox table in the
// caller's business transaction and published by a [Relay] after the
// commit.
//
// The writing fields (ID, Topic, Key, Payload, Headers) are what the
// producer sets. The reading fields (Seq, CreatedAt, Attempts) are filled
// by the store when the relay reads the row; a writer leaves them zero.
type Message struct {
	// ID is the stable identity of the logical event. It is stored with
	// the row and sent as the broker's deduplication header on every
	// publish attempt, so that the consumer's dedup absorbs the relay's
	// retries. Empty: the writer draws one with [NewID] once, when it
	// writes the row (never per attempt).
	ID string
	// Topic is where the event is published: a NATS subject, a RabbitMQ
	// routing key, a Kafka topic. Required.
	Topic string
	// Key is the aggregate key ("order/42"): the unit of ordering and of
	// partitioning. Messages of one Key are published in commit order; a
	// quarantined message holds up only its own Key. Empty is one
	// aggregate of its own like any other key.
	Key string
	// Payload is the body, published as is.
	Payload []byte
	// Headers are published with the message (W3C traceparent and
	// tracestate included when the caller sets them).
	Headers map[string]string

	// Seq is the row's position in the outbox table (its id), set by the
	// store when it reads the row.
	Seq int64
	// CreatedAt is when the row was written, by the store's clock.
	CreatedAt time.Time
	// Attempts counts earlier failed publish attempts of this row.
	Attempts int
}

// Validate checks the writing fields against the limits above and returns
// a [*dedup.ArgumentError] naming the first bad one. An empty ID is valid
// (the writer fills it).
func (m *Message) Validate() error {
	if m == nil {
		return bad("message", "is nil")
	}
	if len(m.ID) > MaxIDLen {
		return bad("message ID", "is longer than "+itoa(MaxIDLen)+" bytes")
	}
	if !printable(m.ID) {
		return bad("message ID", "is not printable UTF-8 without spaces")
	}
	if m.Topic == "" {
		return bad("message topic", "is empty")
	}
	if len(m.Topic) > MaxTopicLen {
		return bad("message topic", "is longer than "+itoa(MaxTopicLen)+" bytes")
	}
	if !printable(m.Topic) {
		return bad("message topic", "is not printable UTF-8 without spaces")
	}
	if len(m.Key) > MaxKeyLen {
		return bad("message key", "is longer than "+itoa(MaxKeyLen)+" bytes")
	}
	if !utf8.ValidString(m.Key) || strings.IndexByte(m.Key, 0) >= 0 {
		return bad("message key", "is not valid UTF-8 or contains NUL")
	}
	if len(m.Payload) > MaxPayloadSize {
		return bad("message payload", "is larger than "+itoa(MaxPayloadSize)+" bytes")
	}
	if len(m.Headers) > MaxHeaders {
		return bad("message headers", "are more than "+itoa(MaxHeaders))
	}
	for k, v := range m.Headers {
		if k == "" || !printable(k) || strings.ContainsAny(k, ":") {
			return bad("message header name "+strconv.Quote(k), "is not a printable name without spaces or colons")
		}
		if len(k)+len(v) > MaxHeaderLen {
			return bad("message header "+k, "is longer than "+itoa(MaxHeaderLen)+" bytes")
		}
		if !utf8.ValidString(v) || strings.ContainsAny(v, "\x00\r\n") {
			return bad("message header "+k, "value is not valid UTF-8 or contains NUL, CR or LF")
		}
	}
	return nil
}

// NewID returns a new message ID: a UUID version 7 (time-ordered, 74
// random bits), prefixed by namespace and a colon when namespace is not
// empty ("billing:0190c1d2-...").
func NewID(namespace string) string {
	var u [16]byte
	_, _ = rand.Read(u[:]) // crypto/rand.Read never fails (Go 1.24+)
	ms := uint64(time.Now().UnixMilli())
	for i := range 6 {
		u[i] = byte(ms >> (40 - 8*i))
	}
	u[6] = u[6]&0x0f | 0x70 // version 7
	u[8] = u[8]&0x3f | 0x80 // RFC 9562 variant
	var b [36]byte
	hex.Encode(b[0:8], u[0:4])
	b[8] = '-'
	hex.Encode(b[9:13], u[4:6])
	b[13] = '-'
	hex.Encode(b[14:18], u[6:8])
	b[18] = '-'
	hex.Encode(b[19:23], u[8:10])
	b[23] = '-'
	hex.Encode(b[24:], u[10:])
	if namespace == "" {
		return string(b[:])
	}
	return namespace + ":" + string(b[:])
}

// Prepare validates m and fills an empty ID with [NewID](""). Writers call
// it before any I/O.
func Prepare(m *Message) error {
	if err := m.Validate(); err != nil {
		return err
	}
	if m.ID == "" {
		m.ID = NewID("")
	}
	return nil
}

func printable(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return false
		}
	}
	return true
}

func bad(arg, reason string) error { return &dedup.ArgumentError{Arg: arg, Reason: reason} }

func itoa(n int) string { return strconv.Itoa(n) }
