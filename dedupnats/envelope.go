package dedupnats

import (
	"strconv"
	"strings"

	"github.com/dedupkit/dedup/consumer"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Header names of the envelope. Header names are case-sensitive in NATS.
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
)

// A HeaderError reports an envelope header whose value cannot be read.
// A consumer dead-letters such a message (see the package documentation);
// the error is the dead letter's reason.
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
	return "dedupnats: malformed " + e.Header + " header " + strconv.Quote(v) + ": " + e.Err.Error()
}

// Unwrap returns the parse error.
func (e *HeaderError) Unwrap() error { return e.Err }

// newMessage reads msg into the broker-neutral envelope. It always returns
// a message filled as far as possible; the error reports a malformed
// envelope header (or a message without JetStream metadata), which the
// consumer dead-letters instead of processing.
func newMessage(msg jetstream.Msg, stream string) (*consumer.Message, error) {
	h := msg.Headers()
	m := &consumer.Message{
		Subject: msg.Subject(),
		Payload: msg.Data(),
	}
	if len(h) > 0 {
		m.Headers = make(map[string]string, len(h))
		for k, v := range h {
			if len(v) > 0 {
				m.Headers[k] = v[0]
			}
		}
	}
	m.BusinessKey = first(h, HeaderBusinessKey)
	m.Aggregate = first(h, HeaderAggregate)
	meta, metaErr := msg.Metadata()
	if metaErr == nil {
		m.Delivery = int(min(meta.NumDelivered, 1<<31-1))
		m.Published = meta.Timestamp
		if meta.Stream != "" {
			stream = meta.Stream
		}
	}
	m.ID = first(h, HeaderMsgID)
	if m.ID == "" {
		m.ID = first(h, jetstream.MsgIDHeader)
	}
	if m.ID == "" && metaErr == nil {
		m.ID = stream + ":" + strconv.FormatUint(meta.Sequence.Stream, 10)
	}
	if metaErr != nil {
		return m, metaErr
	}
	if v := strings.TrimSpace(first(h, HeaderVersion)); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return m, &HeaderError{Header: HeaderVersion, Value: v, Err: err}
		}
		m.Version = n
	}
	return m, nil
}

func first(h nats.Header, name string) string {
	if v := h[name]; len(v) > 0 {
		return v[0]
	}
	return ""
}
