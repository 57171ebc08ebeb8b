package dedupkafka

import (
	"errors"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

func TestEnvelope(t *testing.T) {
	r := &kgo.Record{Topic: "orders", Partition: 2, Offset: 7, Key: []byte("order/42"), Value: []byte("x"),
		Headers: []kgo.RecordHeader{{Key: HeaderVersion, Value: []byte("3")}, {Key: "trace", Value: []byte("a")}, {Key: "trace", Value: []byte("b")}}}
	m, err := newMessage(r, 1)
	if err != nil {
		t.Fatal(err)
	}
	if m.ID != "orders/2/7" || m.Aggregate != "order/42" || m.Version != 3 || m.Headers["trace"] != "a" || m.Headers[HeaderKafkaKey] != "order/42" {
		t.Fatalf("message %+v", m)
	}
	// The republished record keeps the derived ID, the key, the headers.
	back := recordOf(m)
	if string(back.Key) != "order/42" || back.Topic != "orders" {
		t.Fatalf("record %+v", back)
	}
	m2, _ := newMessage(&kgo.Record{Topic: "orders", Offset: 99, Key: back.Key, Headers: back.Headers}, 1)
	if m2.ID != m.ID || m2.Version != 3 {
		t.Fatalf("republished message %+v, want the ID %s", m2, m.ID)
	}
	r.Headers = []kgo.RecordHeader{{Key: HeaderVersion, Value: []byte("v3")}}
	var he *HeaderError
	if _, err := newMessage(r, 1); !errors.As(err, &he) || he.Header != HeaderVersion {
		t.Fatalf("bad version: %v", err)
	}
}

// FuzzEnvelope: any headers parse to a message or a HeaderError, never a
// panic, and a message's republished record reads back to the same IDs.
func FuzzEnvelope(f *testing.F) {
	f.Add("m1", "k", "7", "biz", []byte("key"))
	f.Add("", "", "x", "", []byte(nil))
	f.Fuzz(func(t *testing.T, id, agg, version, biz string, key []byte) {
		r := &kgo.Record{Topic: "t", Key: key, Headers: []kgo.RecordHeader{
			{Key: HeaderMsgID, Value: []byte(id)}, {Key: HeaderAggregate, Value: []byte(agg)},
			{Key: HeaderVersion, Value: []byte(version)}, {Key: HeaderBusinessKey, Value: []byte(biz)}}}
		m, err := newMessage(r, 1)
		if err != nil {
			var he *HeaderError
			if !errors.As(err, &he) {
				t.Fatalf("error %v is not a HeaderError", err)
			}
			return
		}
		m2, err := newMessage(recordOf(m), 1)
		if err != nil || m2.ID != m.ID || m2.BusinessKey != m.BusinessKey || m2.Version != m.Version || m2.Aggregate != m.Aggregate {
			t.Fatalf("round trip: %+v -> %+v (%v)", m, m2, err)
		}
	})
}

// BenchmarkNewMessage is the envelope's cost a record (the adapter's
// per-record work besides the processor), with a message ID header and a
// record key.
func BenchmarkNewMessage(b *testing.B) {
	r := &kgo.Record{Topic: "orders", Partition: 3, Offset: 1234567, Key: []byte("k17"), Value: make([]byte, 128),
		Headers: []kgo.RecordHeader{{Key: HeaderMsgID, Value: []byte("orders-1234567")}}}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := newMessage(r, 1); err != nil {
			b.Fatal(err)
		}
	}
}
