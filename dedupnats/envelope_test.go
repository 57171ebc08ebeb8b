package dedupnats

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dedupkit/dedup"
	"github.com/dedupkit/dedup/consumer"
	"github.com/dedupkit/dedup/memstore"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// fakeMsg is a delivered JetStream message without a server. Methods it
// does not override panic (the embedded interface is nil).
type fakeMsg struct {
	jetstream.Msg
	subject string
	data    []byte
	h       nats.Header
	meta    *jetstream.MsgMetadata
	metaErr error
}

func (f *fakeMsg) Subject() string      { return f.subject }
func (f *fakeMsg) Data() []byte         { return f.data }
func (f *fakeMsg) Headers() nats.Header { return f.h }
func (f *fakeMsg) Metadata() (*jetstream.MsgMetadata, error) {
	if f.metaErr != nil {
		return nil, f.metaErr
	}
	return f.meta, nil
}

func fake(h map[string]string) *fakeMsg {
	nh := nats.Header{}
	for k, v := range h {
		nh.Set(k, v)
	}
	return &fakeMsg{subject: "orders.x", data: []byte("p"), h: nh, meta: &jetstream.MsgMetadata{
		Stream: "ORDERS", NumDelivered: 3, Timestamp: time.Unix(1700000000, 0),
		Sequence: jetstream.SequencePair{Stream: 42, Consumer: 7},
	}}
}

func TestEnvelope(t *testing.T) {
	t.Run("all headers", func(t *testing.T) {
		f := fake(map[string]string{HeaderMsgID: "evt", jetstream.MsgIDHeader: "nats-id", HeaderBusinessKey: "bk",
			HeaderAggregate: "acct", HeaderVersion: " 18446744073709551615 ", "X": "y"})
		f.h.Add("X", "second")
		m, err := newMessage(f, "ORDERS")
		if err != nil {
			t.Fatal(err)
		}
		if m.ID != "evt" || m.BusinessKey != "bk" || m.Aggregate != "acct" || m.Version != 1<<64-1 ||
			m.Subject != "orders.x" || string(m.Payload) != "p" || m.Headers["X"] != "y" || m.Headers[jetstream.MsgIDHeader] != "nats-id" ||
			m.Delivery != 3 || !m.Published.Equal(time.Unix(1700000000, 0)) {
			t.Errorf("message %+v", m)
		}
	})
	t.Run("Nats-Msg-Id fallback", func(t *testing.T) {
		m, err := newMessage(fake(map[string]string{jetstream.MsgIDHeader: "nats-id"}), "ORDERS")
		if err != nil || m.ID != "nats-id" {
			t.Errorf("ID %q, %v", m.ID, err)
		}
	})
	t.Run("sequence fallback", func(t *testing.T) {
		m, err := newMessage(fake(nil), "ORDERS")
		if err != nil || m.ID != "ORDERS:42" || m.Headers != nil {
			t.Errorf("ID %q headers %v, %v", m.ID, m.Headers, err)
		}
	})
	t.Run("empty ID header falls back", func(t *testing.T) {
		m, _ := newMessage(fake(map[string]string{HeaderMsgID: "", jetstream.MsgIDHeader: "n"}), "ORDERS")
		if m.ID != "n" {
			t.Errorf("ID %q", m.ID)
		}
	})
	for _, v := range []string{"v7", "-1", "1.5", "18446744073709551616", "0x10"} {
		t.Run("malformed version "+v, func(t *testing.T) {
			m, err := newMessage(fake(map[string]string{HeaderMsgID: "evt", HeaderVersion: v, HeaderBusinessKey: "bk"}), "ORDERS")
			var he *HeaderError
			if !errors.As(err, &he) || he.Header != HeaderVersion || !strings.Contains(err.Error(), HeaderVersion) {
				t.Fatalf("error %v, want a HeaderError on %s", err, HeaderVersion)
			}
			if m == nil || m.ID != "evt" || m.BusinessKey != "bk" || m.Version != 0 || m.Headers[HeaderVersion] != v {
				t.Errorf("message %+v: the rest of the envelope must still be read", m)
			}
		})
	}
	t.Run("no metadata", func(t *testing.T) {
		f := fake(map[string]string{HeaderMsgID: "evt"})
		f.metaErr = jetstream.ErrNotJSMessage
		m, err := newMessage(f, "ORDERS")
		if !errors.Is(err, jetstream.ErrNotJSMessage) || m.ID != "evt" {
			t.Errorf("message %+v, %v", m, err)
		}
	})
}

// FuzzEnvelope: no header value crashes the envelope reader; the ID is
// never empty; a version is either parsed exactly or reported.
func FuzzEnvelope(f *testing.F) {
	f.Add("evt", "nid", "7", "bk")
	f.Add("", "", "v7", "")
	f.Add("", "x", " 1 ", "\x00")
	f.Add("\xff", "", "99999999999999999999", "é")
	f.Fuzz(func(t *testing.T, id, nid, version, bk string) {
		h := map[string]string{}
		for k, v := range map[string]string{HeaderMsgID: id, jetstream.MsgIDHeader: nid, HeaderVersion: version, HeaderBusinessKey: bk} {
			if v != "" {
				h[k] = v
			}
		}
		m, err := newMessage(fake(h), "S")
		if m == nil || m.ID == "" {
			t.Fatalf("message %+v", m)
		}
		want, perr := strconv.ParseUint(strings.TrimSpace(version), 10, 64)
		switch {
		case strings.TrimSpace(version) == "":
			if err != nil || m.Version != 0 {
				t.Fatalf("no version: %d, %v", m.Version, err)
			}
		case perr != nil:
			var he *HeaderError
			if !errors.As(err, &he) {
				t.Fatalf("version %q accepted as %d", version, m.Version)
			}
		default:
			if err != nil || m.Version != want {
				t.Fatalf("version %q read as %d, %v", version, m.Version, err)
			}
		}
	})
}

// fakeJS stands in for a JetStream context where no call is made.
type fakeJS struct{ jetstream.JetStream }

// TestOptionsValidate: bad arguments and options are argument errors
// from the constructors, never panics.
func TestOptionsValidate(t *testing.T) {
	store, err := memstore.New()
	if err != nil {
		t.Fatal(err)
	}
	p, err := consumer.New("x", store, func(ctx context.Context, m *consumer.Message, d consumer.Delivery) ([]byte, error) {
		return nil, nil
	}, consumer.WithDeadLetter(&consumer.MemoryDLQ{}))
	if err != nil {
		t.Fatal(err)
	}
	js := fakeJS{}
	for name, f := range map[string]func() error{
		"nil js":              func() error { _, err := NewConsumer(nil, "S", "d", p); return err },
		"nil processor":       func() error { _, err := NewConsumer(js, "S", "d", nil); return err },
		"empty stream":        func() error { _, err := NewConsumer(js, "", "d", p); return err },
		"dotted durable":      func() error { _, err := NewConsumer(js, "S", "a.b", p); return err },
		"batch 0":             func() error { _, err := NewConsumer(js, "S", "d", p, WithBatch(0)); return err },
		"concurrency > batch": func() error { _, err := NewConsumer(js, "S", "d", p, WithBatch(2), WithConcurrency(3)); return err },
		"concurrency 0":       func() error { _, err := NewConsumer(js, "S", "d", p, WithConcurrency(0)); return err },
		"max deliver 0":       func() error { _, err := NewConsumer(js, "S", "d", p, WithMaxDeliver(0)); return err },
		"ack wait 10ms":       func() error { _, err := NewConsumer(js, "S", "d", p, WithAckWait(10*time.Millisecond)); return err },
		"fetch wait 0":        func() error { _, err := NewConsumer(js, "S", "d", p, WithFetchWait(0)); return err },
		"nil logger":          func() error { _, err := NewConsumer(js, "S", "d", p, WithLogger(nil)); return err },
		"negative drain":      func() error { _, err := NewConsumer(js, "S", "d", p, WithDrainTimeout(-1)); return err },
		"publisher nil js":    func() error { _, err := NewPublisher(nil); return err },
		"publish attempts 0":  func() error { _, err := NewPublisher(js, WithPublishRetries(0, 0)); return err },
		"expect bad stream":   func() error { _, err := NewPublisher(js, WithExpectStream("a.b")); return err },
		"dlq nil js":          func() error { _, err := NewDLQ(context.Background(), nil, "D"); return err },
		"dlq bad name":        func() error { _, err := NewDLQ(context.Background(), js, "a.b"); return err },
		"dlq wildcard prefix": func() error { _, err := NewDLQ(context.Background(), js, "D", WithSubjectPrefix("a.*")); return err },
		"dlq replicas 0":      func() error { _, err := NewDLQ(context.Background(), js, "D", WithReplicas(0)); return err },
		"dlq window > age": func() error {
			_, err := NewDLQ(context.Background(), js, "D", WithMaxAge(time.Minute), WithDLQDuplicateWindow(time.Hour))
			return err
		},
	} {
		if err := f(); !errors.Is(err, dedup.ErrInvalidArgument) {
			t.Errorf("%s: %v, want an argument error", name, err)
		}
	}
	c, err := NewConsumer(js, "S", "d", p)
	if err != nil {
		t.Fatalf("defaults: %v", err)
	}
	if c.cfg.batch != 64 || c.cfg.concurrency != 1 || c.cfg.maxDeliver != -1 || c.cfg.doubleAck || c.cfg.ackWait != 0 {
		t.Errorf("defaults %+v", c.cfg)
	}
	if got := AckWait(p); got != 37500*time.Millisecond {
		t.Errorf("default AckWait for a 30s lease = %s, want 37.5s", got)
	}
}
